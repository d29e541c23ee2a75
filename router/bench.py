"""`pdsdk bench router`: latency a request gains by going through the router, and KV index speed.

Latency: a fast local fake worker (own process) streams N tokens with no delay; the same
streaming requests go to it directly and through a `pdsdk router` process, at each concurrency
level. Reported: p50/p99 of the whole request and what the router adds (routed minus direct).
Index: BlockStored batches in vLLM's wire format decoded and applied (block events/s), then
prefix lookups of long prompts against the filled index (lookups/s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from pdsdk.benchlog import append_rows, write_json

SECTION = "Router (`pdsdk bench router`)"


def register(sub) -> None:
    p = sub.add_parser("router", help="latency added by the router (1/50/500 streams) and KV index speed",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="1,50,500", help="concurrency levels, comma-separated (default 1,50,500)")
    p.add_argument("--requests", type=int, default=4, help="requests per stream per level (default 4, min 200 total)")
    p.add_argument("--tokens", type=int, default=8, help="tokens each streamed answer carries (default 8)")
    p.add_argument("--policy", default="round_robin", help="router policy during the latency runs")
    p.add_argument("--index-blocks", type=int, default=200_000, help="block events to ingest (default 200000)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--json", dest="json_out", help="write the records to this file")
    p.add_argument("--doc", default="docs/benchmarks.md", help="markdown file to append rows to ('' for none)")
    p.set_defaults(func=run)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


async def _load(url: str, streams: int, total: int, tokens: int) -> tuple[list[float], float]:
    import aiohttp

    body = {"model": "fake-model", "prompt": "benchmark prompt " * 16, "max_tokens": tokens, "stream": True}
    lat: list[float] = []
    todo = iter(range(total))

    async def client(session):
        for _ in todo:
            t0 = time.perf_counter()
            async with session.post(url + "/v1/completions", json=body) as r:
                async for _chunk in r.content.iter_any():
                    pass
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status} from {url}")
            lat.append(time.perf_counter() - t0)

    conn = aiohttp.TCPConnector(limit=streams + 8)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        await asyncio.gather(*(client(s) for _ in range(min(streams, 8))))  # warm up connections
        lat.clear()
        todo = iter(range(total))
        start = time.perf_counter()
        await asyncio.gather(*(client(s) for _ in range(streams)))
        return lat, time.perf_counter() - start


def _spawn(argv: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    import socket

    for _ in range(400):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited with {proc.returncode}")
            time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"{' '.join(argv)} did not listen on {port}")


def latency(args) -> list[dict[str, Any]]:
    from pdsdk.router.harness import free_port

    wport, rport = free_port(), free_port()
    worker = _spawn([sys.executable, "-m", "pdsdk.router.fakeworker", "--port", str(wport),
                     "--chunks", str(args.tokens)], wport)
    cli = [sys.executable, "-m", "pdsdk", "router", "--port", str(rport), "--worker",
           f"http://127.0.0.1:{wport}", "--policy", args.policy]
    router = _spawn(cli, rport)
    out = []
    try:
        for streams in [int(s) for s in args.streams.split(",") if s]:
            total = max(200, streams * args.requests)
            rec = {}
            for case, port in (("direct", wport), ("router", rport)):
                lat, secs = asyncio.run(_load(f"http://127.0.0.1:{port}", streams, total, args.tokens))
                rec[case] = {"case": case, "streams": streams, "requests": total, "p50_ms": round(_pct(lat, .5), 3),
                             "p99_ms": round(_pct(lat, .99), 3), "mean_ms": round(statistics.fmean(lat) * 1e3, 3),
                             "rps": round(total / secs, 1)}
            d, r = rec["direct"], rec["router"]
            r["added_p50_ms"] = round(r["p50_ms"] - d["p50_ms"], 3)
            r["added_p99_ms"] = round(r["p99_ms"] - d["p99_ms"], 3)
            r["added_p99_ratio"] = round(r["p99_ms"] / d["p99_ms"], 2) if d["p99_ms"] else None
            out += [d, r]
    finally:
        for p in (router, worker):
            p.terminate()
            p.wait(10)
    return out


def index_speed(args) -> dict[str, Any]:
    from pdsdk.router import fake_events as fe
    from pdsdk.router.kvindex import KVIndex
    from pdsdk.router.kvwire import decode_batch

    bs, per_batch, sources = args.block_size, 16, 4
    prompt_blocks = 128  # 2048-token prompts
    payloads = []
    n = 0
    seq_id = 0
    while n < args.index_blocks:  # prompts of 128 blocks, published 16 blocks per batch, parents chained
        toks = list(range(seq_id * 100_000, seq_id * 100_000 + prompt_blocks * bs))
        hashes = fe.chain(toks, bs, salt=seq_id)
        for i in range(0, prompt_blocks, per_batch):
            parent = hashes[i - 1] if i else None
            ev = fe.stored("vllm", hashes[i:i + per_batch], parent, toks[i * bs:(i + per_batch) * bs], bs)
            payloads.append((f"src{seq_id % sources}", fe.encode_batch("vllm", [ev])))
            n += per_batch
        seq_id += 1
    idx = KVIndex()
    t0 = time.perf_counter()
    for src, payload in payloads:
        idx.apply(src, decode_batch(payload)[1])
    ingest = time.perf_counter() - t0
    lookups = 2000
    probes = [list(range(i % seq_id * 100_000, i % seq_id * 100_000 + prompt_blocks * bs)) for i in range(lookups)]
    t0 = time.perf_counter()
    for p in probes:
        idx.lookup(p)
    look = time.perf_counter() - t0
    return {"case": "kv_index", "streams": 0, "blocks": n, "block_size": bs,
            "events_per_s": round(n / ingest), "lookups_per_s": round(lookups / look),
            "lookup_prompt_tokens": prompt_blocks * bs}


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)
    with console.status("router latency: direct vs routed..."):
        records = latency(args)
    with console.status("KV index: ingest and lookups..."):
        records.append(index_speed(args))
    table = Table(title=f"pdsdk bench router ({os.cpu_count()} cores, fake worker, {args.tokens} tokens/stream)")
    for col in ("case", "streams", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "req/s", "events/s", "lookups/s"):
        table.add_column(col)
    for r in records:
        table.add_row(r["case"], str(r["streams"]), str(r.get("p50_ms", "")), str(r.get("p99_ms", "")),
                      str(r.get("added_p50_ms", "")), str(r.get("added_p99_ms", "")), str(r.get("rps", "")),
                      f"{r['events_per_s']:,}" if "events_per_s" in r else "",
                      f"{r['lookups_per_s']:,}" if "lookups_per_s" in r else "")
    console.print(table)
    write_json(args.json_out, records)
    if args.doc and os.path.exists(args.doc):
        rows = [[r["case"], r["streams"], r.get("p50_ms", ""), r.get("p99_ms", ""),
                 f"{r['added_p99_ms']} ({r['added_p99_ratio']}x direct)" if "added_p99_ms" in r else "",
                 f"{r['events_per_s']:,}" if "events_per_s" in r else "",
                 f"{r['lookups_per_s']:,}" if "lookups_per_s" in r else ""] for r in records]
        console.print(f"appended {len(rows)} rows to {append_rows(args.doc, SECTION, rows)}")
    return 0
