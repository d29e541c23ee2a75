"""`pdsdk bench store`: put/get GB/s and pages/s per store and page size, beside ceilings measured
in the same run (the machines are shared and noisy): a memory copy for in-memory and remote
stores, and the disk's own sequential write (read) speed, through the page cache like the store,
for the disk store."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from pdsdk.bench.log import append_rows, write_json

SECTION = "Stores (`pdsdk bench store`)"
BATCH = 16  # pages per put/get call, as an engine hands over a run of pages


def register(sub) -> None:
    p = sub.add_parser("store", help="store put/get GB/s vs memory copy and the disk's sequential speed",
                       description=__doc__)
    p.add_argument("--stores", default="memory,disk", help="comma-separated (default memory,disk); "
                   "redis and mooncake need --servers or their options")
    p.add_argument("--sizes", default="16K,64K,256K,1M,2M", help="page sizes (default 16K,64K,256K,1M,2M)")
    p.add_argument("--total", default="128M", help="bytes moved per cell and repeat (default 128M)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per cell; the median is reported")
    p.add_argument("--path", default=None, help="directory for the disk store (default: a temporary one)")
    p.add_argument("--servers", action="store_true", help="start redis-server and mooncake_master locally")
    p.add_argument("--redis-url", default=None,
                   help="bench a running redis (default: start redis-server on a free port)")
    p.add_argument("--mooncake-master", default=None)
    p.add_argument("--json", dest="json_out", help="write the records to this file")
    p.add_argument("--doc", default="", help="markdown file to append 1 MiB rows to (e.g. docs/benchmarks.md; default: none)")
    p.set_defaults(func=run)


def size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def _median_rate(fn, repeats: int, nbytes: int) -> float:
    """Median seconds of `fn` turned into GB/s (1e9 bytes/s)."""
    times = [fn() for _ in range(repeats)]
    return nbytes / statistics.median(times) / 1e9


def copy_ceiling(page: int, total: int, repeats: int) -> float:
    """What a get does at best: copy distinct resident pages (a working set as large as the
    store's) into a batch of reused output buffers."""
    n = max(BATCH, total // page)
    src = np.ones(n * page, np.uint8)  # touched: resident like a store's pages
    dst = [np.empty(page, np.uint8) for _ in range(BATCH)]

    def once():
        t = time.perf_counter()
        for i in range(n):
            np.copyto(dst[i % BATCH], src[i * page:(i + 1) * page])
        return time.perf_counter() - t

    return _median_rate(once, repeats, n * page)


def disk_ceiling(directory: Path, page: int, total: int, repeats: int) -> tuple[float, float]:
    """Sequential write and read of one file in page-sized calls, through the page cache."""
    buf = np.frombuffer(os.urandom(page), np.uint8)
    out = bytearray(page)
    n = total // page
    path = directory / f"seq-{uuid.uuid4().hex}"

    def write():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        t = time.perf_counter()
        for _ in range(n):
            os.write(fd, buf)
        dt = time.perf_counter() - t
        os.close(fd)
        return dt

    def read():
        fd = os.open(path, os.O_RDONLY)
        t = time.perf_counter()
        for i in range(n):
            os.preadv(fd, [out], i * page)
        dt = time.perf_counter() - t
        os.close(fd)
        return dt

    try:
        w = _median_rate(write, repeats, n * page)
        r = _median_rate(read, repeats, n * page)
    finally:
        path.unlink(missing_ok=True)
    return w, r


def bench_store(store, page: int, total: int, repeats: int) -> dict[str, float]:
    n = max(BATCH, total // page // BATCH * BATCH)
    pages = [np.frombuffer(os.urandom(page), np.uint8) for _ in range(BATCH)]
    outs = [np.empty(page, np.uint8) for _ in range(BATCH)]
    put_times, get_times = [], []
    for _ in range(repeats):
        salt = uuid.uuid4().bytes
        keys = [salt + i.to_bytes(8, "big") for i in range(n)]
        t = time.perf_counter()
        for i in range(0, n, BATCH):
            store.put(keys[i:i + BATCH], pages)
        put_times.append(time.perf_counter() - t)
        hits = 0
        t = time.perf_counter()
        for i in range(0, n, BATCH):
            hits += store.get(keys[i:i + BATCH], outs)
        get_times.append(time.perf_counter() - t)
        if hits != n or not np.array_equal(outs[-1], pages[-1]):
            raise RuntimeError(f"{store.name}: {hits} of {n} pages came back ({page}-byte pages)")
        store.delete(keys)
    put_s, get_s = statistics.median(put_times), statistics.median(get_times)
    return {"put": (n * page / put_s / 1e9, n / put_s), "get": (n * page / get_s / 1e9, n / get_s)}


def _open_stores(args, tmp: Path, total: int, servers: list):
    from pdsdk.connectors.stores.factory import open_store

    options = {"memory": {"capacity_bytes": 2 * total + (64 << 20)},
               "disk": {"path": str(Path(args.path) if args.path else tmp / "disk"), "capacity_bytes": 4 * total},
               "lmcache": {"cpu_bytes": 2 * total + (64 << 20)}}
    if args.servers:
        from pdsdk.testing.servers import start_mooncake_master, start_redis

        redis_srv = start_redis(tmp, maxmemory=f"{(2 * total) >> 20}mb")
        servers.append(redis_srv)
        args.redis_url = args.redis_url or f"redis://127.0.0.1:{redis_srv.port}/0"
        if "mooncake" in args.stores:
            master = start_mooncake_master(tmp)
            servers.append(master)
            args.mooncake_master = args.mooncake_master or f"127.0.0.1:{master.port}"
    if args.redis_url:
        options["redis"] = {"url": args.redis_url}
    if args.mooncake_master:
        options["mooncake"] = {"master": args.mooncake_master, "segment_bytes": 2 * total + (64 << 20)}
    for name in [s.strip() for s in args.stores.split(",") if s.strip()]:
        yield name, open_store({"name": name, "options": options.get(name, {})})


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    sizes = [size(s) for s in args.sizes.split(",")]
    total = size(args.total)
    records, servers = [], []
    with tempfile.TemporaryDirectory(prefix="pdsdk-bench-store-") as tmpdir:
        tmp = Path(tmpdir)
        disk_dir = Path(args.path) if args.path else tmp
        disk_dir.mkdir(parents=True, exist_ok=True)
        ceilings = {}
        for page in sizes:
            copy = copy_ceiling(page, total, args.repeats)
            seq_w, seq_r = disk_ceiling(disk_dir, page, total, args.repeats)
            ceilings[page] = {"memcpy": copy, "disk seq write": seq_w, "disk seq read": seq_r}
            for name, gbps in ceilings[page].items():
                records.append({"store": f"({name})", "op": "ceiling", "page_bytes": page, "gbps": round(gbps, 3),
                                "ops_per_s": round(gbps * 1e9 / page), "ratio_to_ceiling": 1.0, "ceiling": name})
        try:
            for name, store in _open_stores(args, tmp, total, servers):
                try:
                    for page in sizes:
                        result = bench_store(store, page, total, args.repeats)
                        for op, (gbps, ops) in result.items():
                            ceiling = ("disk seq write" if op == "put" else "disk seq read") if name == "disk" \
                                else "memcpy"
                            records.append({"store": name, "op": op, "page_bytes": page, "gbps": round(gbps, 3),
                                            "ops_per_s": round(ops), "ceiling": ceiling,
                                            "ratio_to_ceiling": round(gbps / ceilings[page][ceiling], 3)})
                finally:
                    store.close()
        finally:
            for server in servers:
                server.stop()

    table = Table("store", "op", "page", "GB/s", "pages/s", "ratio", "ceiling")
    for r in records:
        table.add_row(r["store"], r["op"], f"{r['page_bytes'] >> 10} KiB", f"{r['gbps']:.2f}",
                      f"{r['ops_per_s']:,}", f"{r['ratio_to_ceiling']:.2f}", r["ceiling"])
    console.print(table)
    write_json(args.json_out, records)
    if args.doc:
        mib = [r for r in records if r["page_bytes"] == 1 << 20 and r["op"] != "ceiling"]
        rows = [[r["store"], r["op"], "1 MiB", f"{r['gbps']:.2f}", f"{r['ops_per_s']:,}",
                 f"{r['ratio_to_ceiling']:.2f}", f"{ceilings[1 << 20][r['ceiling']]:.2f} ({r['ceiling']})"]
                for r in mib]
        if rows:
            console.print(f"appended {len(rows)} rows to {append_rows(args.doc, SECTION, rows)}")
    return 0
