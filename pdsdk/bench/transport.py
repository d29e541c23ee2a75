"""`pdsdk bench transport`: every transport between two processes, beside the machine's ceiling.

Ceiling: on CPU, one process copying into another process's shared memory (the best any
same-host path can do); on GPU, a torch peer copy between the two devices. Cases: contiguous
transfers of each size, and the paged case: scattered, out-of-order pages (default 4608 x 32 KiB,
1024 tokens of a Qwen3-8B-shaped cache). Bytes are verified after the timed runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import sys
import time
from typing import Any

import numpy as np

from pdsdk.bench.log import append_rows, write_json

MiB = 1 << 20
log = logging.getLogger(__name__)


def register(sub) -> None:
    p = sub.add_parser("transport", help="transport GB/s between two processes vs the machine's ceiling",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", default="", help="comma-separated (default: every loadable transport)")
    p.add_argument("--sizes", default="1,16,256", help="contiguous sizes in MiB, comma-separated (default 1,16,256)")
    p.add_argument("--pages", type=int, default=4608, help="pages in the paged case (default 4608; 0 skips it)")
    p.add_argument("--page-bytes", type=int, default=32 << 10,
                   help="bytes per page, a multiple of 2048 (default 32768)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per cell; the median is reported")
    p.add_argument("--op", choices=("read", "write"), default="read", help="read = pull model (decode reads)")
    p.add_argument("--device", default="cpu", help="this side's memory: cpu or cuda:N")
    p.add_argument("--peer-device", default=None, help="the peer's memory (default: cuda:1 if --device is cuda)")
    p.add_argument("--staging", choices=("auto", "on", "off"), default="auto",
                   help="staged path for scattered pages, on transports that have one (default: the cost rule)")
    p.add_argument("--option", action="append", default=[], metavar="T.KEY=VALUE",
                   help="a transport option, e.g. mooncake.protocol=nvlink (repeatable; VALUE is JSON or text)")
    p.add_argument("--timeout", type=float, default=60.0, help="per-transfer deadline in seconds")
    p.add_argument("--json", dest="json_out", help="write the records to this file")
    p.add_argument("--doc", default="", help="markdown file to append a row to (e.g. docs/benchmarks.md; default: none)")
    p.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from pdsdk.plugins import registry

    console = Console(width=None if sys.stdout.isatty() else 150)
    reg = registry()
    transport_options(args.option)  # bad --option: fail before any peer starts
    if args.page_bytes <= 0 or args.page_bytes % PAGE_UNIT:
        from pdsdk.errors import ConfigError

        raise ConfigError("--page-bytes", f"{args.page_bytes} is not a positive multiple of {PAGE_UNIT} "
                                          "(a page is KV heads x head_dim 32 x 32 tokens x 2 bytes)")
    names = [n for n in args.transports.split(",") if n] or \
        [n for n in reg.names("transport") if reg.get("transport", n).why_not is None]
    peer_device = args.peer_device or ("cpu" if args.device == "cpu" else "cuda:1")
    sizes = [int(float(s) * MiB) for s in args.sizes.split(",") if s]
    paged_bytes = args.pages * args.page_bytes
    region = max([*sizes, 2 * paged_bytes])
    records: list[dict[str, Any]] = []
    with console.status("measuring the ceiling...") as status:
        for nbytes in sorted({*sizes, paged_bytes} - {0}):
            seconds = ceiling(nbytes, args.repeats, args.device, peer_device)
            records.append(_record("ceiling", "contiguous", nbytes, 1, seconds, True, "shm copy" if args.device == "cpu"
                                   else "torch peer copy"))
        ceil = {r["bytes"]: r["gbps"] for r in records}
        for name in names:
            status.update(f"{name}: starting peer...")
            try:
                records += bench_one(name, args, sizes, region, peer_device, status)
            except Exception as e:  # noqa: BLE001 - one broken transport must not hide the others
                log.debug("%s failed", name, exc_info=True)
                console.print(f"[red]{name} failed:[/] {type(e).__name__}: {e}")
                records.append({"transport": name, "case": "error", "error": f"{type(e).__name__}: {e}"})
    for r in records:
        if "gbps" in r:
            r["ratio_to_ceiling"] = round(r["gbps"] / ceil[r["bytes"]], 3) if ceil.get(r["bytes"]) else None
    contiguous_at = {(r["transport"], r["bytes"]): r["gbps"] for r in records if r.get("case") == "contiguous"}
    for r in records:
        if r.get("case") == "paged":
            base = contiguous_at.get((r["transport"], r["bytes"]))
            r["ratio_to_contiguous"] = round(r["gbps"] / base, 3) if base else None

    table = Table(title=f"pdsdk bench transport ({args.op}, {args.device} -> {peer_device})")
    for col in ("transport", "case", "bytes", "pages", "ms", "GB/s", "x ceiling", "x contiguous", "verified", "path"):
        table.add_column(col)
    for r in records:
        if "gbps" not in r:
            continue
        table.add_row(r["transport"], r["case"], f"{r['bytes'] / MiB:g} MiB", str(r["pages"]),
                      f"{r['seconds'] * 1e3:.2f}", f"{r['gbps']:.2f}", f"{r.get('ratio_to_ceiling') or 0:.2f}",
                      f"{r['ratio_to_contiguous']:.2f}" if r.get("ratio_to_contiguous") else "",
                      "yes" if r["verified"] else "[red]NO[/]", r["path"])
    console.print(table)
    write_json(args.json_out, records)
    if args.doc:
        _append_doc(args, records, console)
    return 0 if all(r.get("verified", True) and r.get("case") != "error" for r in records) else 1


def _record(transport: str, case: str, nbytes: int, pages: int, seconds: float, verified: bool,
            path: str) -> dict[str, Any]:
    return {"transport": transport, "case": case, "bytes": nbytes, "pages": pages, "seconds": seconds,
            "gbps": round(nbytes / seconds / 1e9, 3), "verified": verified, "path": path}


PAGE_UNIT = 32 * 32 * 2  # one KV head of head_dim 32 over a 32-token page, 2-byte dtype


def bench_one(name: str, args, sizes: list[int], region_bytes: int, peer_device: str, status) -> list[dict]:
    from pdsdk.connectors.transports.common.buffers import allocate, torch_view
    from pdsdk.connectors.transports.factory import open_transport
    from pdsdk.kv import KVLayout, page_spans
    from pdsdk.plugins import registry
    from pdsdk.testing.peer import start_peer

    # The paged case's page is one layout page: heads x head_dim x page_size x 2 bytes.
    layout = {"num_layers": 1, "num_kv_heads": args.page_bytes // PAGE_UNIT, "head_dim": 32, "page_size": 32}
    cls = registry().load("transport", name)
    options = {"staging": args.staging} if cls.SUPPORTS_STAGING else {}
    options.update(transport_options(args.option).get(name, {}))
    transport = open_transport(name, layout=KVLayout(**layout, device=args.device), transfer_timeout_s=args.timeout,
                               **options)
    buf, region = allocate(region_bytes, args.device)
    transport.register([region])
    peer = start_peer(name, region_bytes, device=peer_device, layout=layout, timeout=args.timeout, options=options)
    records = []
    try:
        remote = transport.connect(peer.descriptor)
        peer.call("fill", seed=1)
        post = transport.read if args.op == "read" else transport.write
        post_pages = transport.read_pages if args.op == "read" else transport.write_pages

        def local_digest(spans: np.ndarray) -> str:
            h = hashlib.sha256()
            for _, off, n in spans.tolist():
                view = torch_view(region.addr + off, n, args.device).cpu().numpy() if args.device != "cpu" \
                    else buf[off:off + n]
                h.update(view.tobytes())
            return h.hexdigest()

        def timed(local: np.ndarray, rem: np.ndarray, what: str, pages: tuple | None = None) -> tuple[float, bool]:
            times = []
            for i in range(args.repeats + 1):  # +1: the first run warms up connections and page tables
                status.update(f"{name}: {what} run {i + 1}/{args.repeats + 1}")
                start = time.perf_counter()
                st = transport.wait(post_pages(remote, 0, pages[0], 0, pages[1]) if pages else post(remote, local, rem))
                if st.state != "done":
                    raise RuntimeError(f"{what}: {st.reason}")
                times.append(time.perf_counter() - start)
            if args.op == "read":
                ok = local_digest(local) == peer.call("digest", spans=rem.tolist())["digest"]
            else:
                ok = local_digest(local) == peer.call("digest", spans=rem.tolist())["digest"]
            return statistics.median(times[1:]), ok

        if args.op == "write":
            _fill_local(buf, args.device)
        paged_bytes = args.pages * args.page_bytes
        for nbytes in sorted({*sizes, paged_bytes} - {0}):
            spans = np.array([[0, 0, nbytes]], dtype=np.int64)
            seconds, ok = timed(spans, spans, f"contiguous {nbytes / MiB:g} MiB")
            records.append(_record(name, "contiguous", nbytes, 1, seconds, ok, transport.path()))
        if args.pages:
            rng = np.random.default_rng(7)
            slots = region_bytes // args.page_bytes
            local_ids, remote_ids = rng.permutation(slots)[:args.pages], rng.permutation(slots)[:args.pages]
            local, rem = page_spans(0, local_ids, args.page_bytes), page_spans(0, remote_ids, args.page_bytes)
            seconds, ok = timed(local, rem, f"paged {args.pages} x {args.page_bytes} B", (local_ids, remote_ids))
            how = "" if not cls.SUPPORTS_STAGING else \
                " staged" if transport._use_staging(remote, local, paged_bytes) else " direct"
            records.append(_record(name, "paged", paged_bytes, args.pages, seconds, ok, transport.path() + how))
    finally:
        peer.close()
        transport.close()
    return records


def transport_options(items: list[str]) -> dict[str, dict[str, Any]]:
    """`["mooncake.protocol=nvlink", ...]` -> {"mooncake": {"protocol": "nvlink"}}."""
    from pdsdk.errors import ConfigError

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, _, value = item.partition("=")
        transport, _, key = name.partition(".")
        if not (transport and key and _):
            raise ConfigError("--option", f"{item!r} is not T.KEY=VALUE, e.g. mooncake.protocol=nvlink")
        try:
            out.setdefault(transport, {})[key] = json.loads(value)
        except json.JSONDecodeError:
            out.setdefault(transport, {})[key] = value
    return out


def _fill_local(buf: Any, device: str) -> None:
    data = np.random.default_rng(2).integers(0, 256, size=len(buf), dtype=np.uint8)
    if device == "cpu":
        buf[:] = data
    else:
        import torch

        buf.copy_(torch.from_numpy(data))


def ceiling(nbytes: int, repeats: int, device: str, peer_device: str) -> float:
    """Median seconds of the best same-host copy of `nbytes` into another process's (or GPU's) memory."""
    if device != "cpu":
        import torch

        src = torch.ones(nbytes, dtype=torch.uint8, device=peer_device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
    import multiprocessing as mp
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=nbytes)
    try:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_copy_into_shm, args=(shm.name, nbytes, repeats, child))
        proc.start()
        times = parent.recv()
        proc.join(60)
    finally:
        shm.close()
        shm.unlink()
    return statistics.median(times[1:])


def _copy_into_shm(name: str, nbytes: int, repeats: int, conn) -> None:
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=name)
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.ndarray((nbytes,), dtype=np.uint8, buffer=shm.buf)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    del dst
    shm.close()
    conn.send(times)


def _append_doc(args, records: list[dict], console) -> None:
    from pathlib import Path

    if not Path(args.doc).exists():
        console.print(f"(no {args.doc} here: not appending a row)")
        return
    keep = [r for r in records if "gbps" in r and (r["case"] == "paged" or r["bytes"] >= 256 * MiB)]
    rows = [[f"{r['case']} ({args.op}, {args.device})", r["transport"],
             f"{r['bytes'] / MiB:g} MiB" + (f" / {r['pages']} pages" if r["case"] == "paged" else ""),
             f"{r['gbps']:.2f}", f"{r.get('ratio_to_ceiling') or 0:.2f}"
             + (f" ({r['ratio_to_contiguous']:.2f} of contiguous)" if r.get("ratio_to_contiguous") else ""),
             "yes" if r["verified"] else "NO"] for r in keep]
    console.print(f"appended {len(rows)} rows to {append_rows(args.doc, 'Transports (`pdsdk bench transport`)', rows)}")
