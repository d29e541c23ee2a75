"""`pdsdk bench store-path`: whole KV blocks of a vLLM-shaped cache into and out of a store through the
connector's own data path (adapters/common/store_io.py), bytes verified, against the ceiling measured
in the same run: a memcpy of the same bytes on a host, the pinned host <-> GPU copy on a GPU.

The cache has the Qwen3-8B shape by default (36 layers, 8 KV heads, head_dim 128, bf16, block 16: a
page is 2.25 MiB). `save` is timed from the call to the moment every page landed in the store; `load`
from the call until the blocks are in the cache. Each case runs once to warm up (pool growth, kernel
compilation), then `--repeats` times; the best run is reported.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import numpy as np

from pdsdk.bench.log import append_rows, write_json

SECTION = "Store path (`pdsdk bench store-path`)"


def register(sub) -> None:
    p = sub.add_parser("store-path", help="KV blocks <-> a store through the connector's data path, vs the copy "
                       "ceiling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    p.add_argument("--store", default="memory", help='store config: a name or JSON (default memory, sized to fit)')
    p.add_argument("--blocks", type=int, default=256, help="blocks per save/load (default 256: 4096 tokens)")
    p.add_argument("--layers", type=int, default=36, help="layers (default 36)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head size (default 128)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case; the best is reported (default 3)")
    p.add_argument("--json", dest="json_out", help="write the records to this file")
    p.add_argument("--doc", default="", help="markdown file to append rows to (e.g. docs/benchmarks.md; default: none)")
    p.set_defaults(func=run)


def kv_cache(args, num_blocks: int) -> list[Any]:
    import torch

    shape = (2, num_blocks, args.block_size, args.kv_heads, args.head_dim)  # vLLM's flash-attention layout
    return [torch.empty(shape, dtype=torch.bfloat16, device=args.device) for _ in range(args.layers)]


def ceiling(nbytes: int, device: str, repeats: int) -> dict[str, float]:
    """Seconds to move `nbytes` once: memcpy on a host; pinned <-> GPU each way on a GPU."""
    import torch

    if device == "cpu":
        src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        np.copyto(dst, src)
        best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
        return {"save": best, "load": best}
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for case, (dst, src) in {"save": (host, gpu), "load": (gpu, host)}.items():
        dst.copy_(src)
        torch.cuda.synchronize(device)
        out[case] = min(_timed(lambda d=dst, s=src: (d.copy_(s, non_blocking=True), torch.cuda.synchronize(device)))
                        for _ in range(repeats))
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(args) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from pdsdk.adapters.common.store_io import BlockLayout, StoreIO
    from pdsdk.adapters.vllm.pages import block_geometry
    from pdsdk.config import load_config
    from pdsdk.connectors.stores.factory import open_store

    console = Console()
    n = args.blocks
    num_blocks = 2 * n + 1  # saves read blocks [0, n), loads write [n, 2n)
    tensors = kv_cache(args, num_blocks)
    for t in tensors[:]:
        t.view(torch.int16).random_()
    geometry = [block_geometry(t, num_blocks) for t in tensors]
    device = None if args.device == "cpu" else int(args.device.partition(":")[2] or 0)
    layout = BlockLayout([t.data_ptr() for t in tensors], geometry, device)
    nbytes = n * layout.page_bytes
    spec = load_config({"store": _parse(args.store), "transport": None}, check_plugins=False).store
    if spec.name == "memory" and "capacity_bytes" not in spec.options:
        spec.options["capacity_bytes"] = 2 * nbytes
    store = open_store(spec)
    path = StoreIO(store, layout)
    ceilings = ceiling(nbytes, args.device, args.repeats)
    save_ids, load_ids = list(range(n)), list(range(n, 2 * n))
    records = []
    try:
        for case in ("save", "load"):
            best = None
            for i in range(args.repeats + 1):  # the first run warms up
                keys = [f"bench-{case}-{i}-{b}".encode() for b in range(n)] if case == "save" else \
                    [f"bench-save-{args.repeats}-{b}".encode() for b in range(n)]  # the last save's pages
                seconds, moved = _save(path, save_ids, keys) if case == "save" else _load(path, load_ids, keys)
                if i and (best is None or seconds < best[0]):
                    best = (seconds, moved)
            seconds, moved = best
            verified = moved == n and (case == "save" or _same(tensors, save_ids, load_ids))
            gbps = nbytes / seconds / 1e9
            ceil = nbytes / ceilings[case] / 1e9
            records.append({"case": case, "device": args.device, "store": spec.name, "blocks": n, "bytes": nbytes,
                            "seconds": round(seconds, 6), "gbps": round(gbps, 2), "ceiling_gbps": round(ceil, 2),
                            "ratio_to_ceiling": round(gbps / ceil, 3), "verified": bool(verified)})
    finally:
        path.close()
        store.close()
    table = Table(title=f"store path: {n} blocks of {layout.page_bytes >> 10} KiB on {args.device}, store {spec.name}")
    for col in ("case", "MiB", "ms", "GB/s", "ceiling GB/s", "ratio", "verified"):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(r["case"], f"{r['bytes'] / 2**20:.0f}", f"{r['seconds'] * 1e3:.2f}", f"{r['gbps']:.1f}",
                      f"{r['ceiling_gbps']:.1f}", f"{r['ratio_to_ceiling']:.2f}", str(r["verified"]))
    console.print(table)
    if args.json_out:
        write_json(args.json_out, records)
    if args.doc:
        from pdsdk.bench.log import machine

        rows = [[time.strftime("%Y-%m-%d"), machine(), r["device"], r["store"], r["case"], r["blocks"],
                 r["gbps"], r["ceiling_gbps"], r["ratio_to_ceiling"], r["verified"]] for r in records]
        console.print(f"appended {len(rows)} rows to {append_rows(args.doc, SECTION, rows)}")
    return 0 if all(r["verified"] for r in records) else 1


def _parse(text: str) -> Any:
    import json

    return json.loads(text) if text.lstrip().startswith(("{", "[", '"')) else text


def _save(path: Any, block_ids: list[int], keys: list[bytes]) -> tuple[float, int]:
    landed = threading.Event()
    stored = []
    start = time.perf_counter()
    if not path.save(block_ids, keys, lambda k: (stored.append(k), landed.set())):
        return float("inf"), 0
    landed.wait()
    return time.perf_counter() - start, stored[0]


def _load(path: Any, block_ids: list[int], keys: list[bytes]) -> tuple[float, int]:
    start = time.perf_counter()
    hits = path.load(block_ids, keys).result()
    return time.perf_counter() - start, hits


def _same(tensors: list[Any], src: list[int], dst: list[int]) -> bool:
    import torch

    s = torch.tensor(src, device=tensors[0].device)
    d = torch.tensor(dst, device=tensors[0].device)
    bits = [t.view(torch.int16) for t in tensors]  # random bits: bf16 NaNs never compare equal
    return all(torch.equal(t.index_select(1, s), t.index_select(1, d)) for t in bits)
