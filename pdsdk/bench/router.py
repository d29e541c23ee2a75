"""`pdsdk bench router`: latency a request gains by going through the router, and KV index speed.

Latency: a lean streaming worker (pdsdk/testing/lean_worker.py, its own process) answers N tokens; the same
streaming requests go to it directly and through a `pdsdk router` process, from a lean client
(this process), in a closed loop at each concurrency level. Client, router and worker are three
processes, so the router's CPU use is measured on its own (from /proc): "router CPU/req".
Reported per level: p50/p99 of the whole request, and what the router adds (routed minus direct
at the same percentile and concurrency).
- saturated (the default levels): the worker has no generation delay, so each level runs as
  fast as the machine allows; once the router's core is busy, requests queue in it and the
  added latency is about streams x router CPU per request (it measures capacity).
- paced (--paced-streams): the worker streams --paced-tokens tokens --paced-itl-ms apart, like
  an engine under load, and the streams start spread over one answer's time, as in a steady
  state; the router is not saturated and what it adds is its own delay.
Index: batches of 16 blocks in vLLM's wire format, as one BlockStored (a prefill) or as 16 of one
block each (decode steps), decoded and applied (block events/s = block hashes ingested per second;
best of 3 passes, wall clock and CPU time of the ingesting thread), then prefix lookups of long
prompts against the filled index (lookups/s).

Comparing with peers (--peer vllm-router,sglang-router; `pip install 'pdsdk[bench-peers]'`):
instead of the runs above, pdsdk's router (--processes N of it, or one per count) and each peer sit in front
of the same --workers lean workers (one process each), round robin, and get the same closed loop
of 1/50/500 keep-alive connections (--streams) for --duration seconds from wrk (when installed;
--client python for the lean client), taking turns --rounds times per level. Per router and level
(its median round): requests/s, p50/p99 of the whole streamed answer, CPU us per request of the
router's whole process tree (/proc), errors, and the ratios to the best peer's requests/s and p99
(the medians of each round's own ratios). A peer that is not installed is
skipped. `--peer none` runs pdsdk's router alone in the same setup.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from pdsdk.bench.log import append_rows, write_json
from pdsdk.bench import router_clients as bench_clients, router_peers as bench_peers
from pdsdk.bench.router_procs import cpu_s, spawn, stop

SECTION = "Router (`pdsdk bench router`)"


def _whole(least: int, what: str):
    """argparse type: a whole number of `what`, at least `least`."""
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"{what} >= {least} expected, got {text!r}")
        return int(text)
    return parse


def _counts(text: str) -> list[int]:
    """argparse type of --processes: whole numbers >= 1, comma-separated."""
    parse = _whole(1, "processes")
    return list(dict.fromkeys(parse(t.strip()) for t in text.split(",")))


def _seconds(least: int):
    return _whole(least, "whole seconds")  # wrk takes no fractions


def register(sub) -> None:
    p = sub.add_parser("router", help="latency added by the router (1/50/500 streams) and KV index speed",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="1,50,500",
                   help="concurrency levels (connections with --peer), comma-separated (default 1,50,500)")
    p.add_argument("--requests", type=int, default=4, help="requests per stream per level (default 4, min 400 total)")
    p.add_argument("--tokens", type=int, default=8, help="tokens each streamed answer carries (default 8)")
    p.add_argument("--paced-streams", type=int, default=500,
                   help="streams of the paced run (default 500; 0 skips it)")
    p.add_argument("--paced-tokens", type=int, default=32, help="tokens per answer in the paced run (default 32)")
    p.add_argument("--paced-itl-ms", type=float, default=100.0,
                   help="ms between tokens in the paced run (default 100: 5000 tokens/s over 500 streams)")
    p.add_argument("--policy", default="round_robin",
                   help="router policy of the latency runs, or of every router with --peer (default round_robin)")
    p.add_argument("--index-blocks", type=int, default=200_000,
                   help="block events to ingest (default 200000; 0 skips the KV index run)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--peer", type=bench_peers.peer_list, default=None, metavar="NAMES",
                   help=f"compare with these routers ({','.join(bench_peers.PEERS)}, or none) instead of the "
                        "runs above")
    p.add_argument("--workers", type=int, default=4, help="--peer: lean worker processes (default 4)")
    p.add_argument("--duration", type=_seconds(1), default=10, help="--peer: seconds per level (default 10)")
    p.add_argument("--rounds", type=_whole(1, "rounds"), default=1,
                   help="--peer: turns each router takes per level; the median round is recorded (default 1; "
                        "3-5 on a shared or noisy machine)")
    p.add_argument("--warmup", type=_seconds(0), default=1,
                   help="--peer: unrecorded seconds before each level (default 1)")
    p.add_argument("--client", choices=("wrk", "python"), default=bench_clients.default_client(),
                   help="--peer: load client (default: wrk when installed, else python)")
    p.add_argument("--client-threads", type=int, default=min(4, max(1, (os.cpu_count() or 1) // 4)),
                   help="--peer: wrk threads (default: a quarter of the cores, 1 to 4)")
    p.add_argument("--processes", type=_counts, default=[1],
                   help="--peer: processes of pdsdk's router, or several counts (4,8,16: one router each; default 1)")
    p.add_argument("--json", dest="json_out", help="write the records to this file")
    p.add_argument("--doc", default="", help="markdown file to append rows to (e.g. docs/benchmarks.md; default: none)")
    p.set_defaults(func=run)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def _measure(case: str, mode: str, port: int, streams: int, total: int, tokens: int,
             procs: dict[str, subprocess.Popen], stagger_s: float = 0.0) -> dict[str, Any]:
    from pdsdk.testing.lean_worker import event_loop_runner, run_load

    body = {"model": "fake-model", "prompt": "benchmark prompt " * 16, "max_tokens": tokens, "stream": True}
    before = {k: cpu_s(p.pid) for k, p in procs.items()}
    gc.collect()
    gc.disable()  # the client's own collector passes (tens of ms with its results held) are not the router's
    c0 = time.process_time()
    try:
        res = event_loop_runner()(run_load("127.0.0.1", port, streams, total, body, stagger_s=stagger_s))
    finally:
        gc.enable()
    client = time.process_time() - c0
    after = {k: cpu_s(p.pid) for k, p in procs.items()}
    lat, first = res.latency, res.ttfb
    rec = {"case": case, "mode": mode, "streams": streams, "requests": total, "tokens": tokens,
           "p50_ms": round(_pct(lat, .5), 3), "p99_ms": round(_pct(lat, .99), 3),
           "mean_ms": round(statistics.fmean(lat) * 1e3, 3), "ttfb_p50_ms": round(_pct(first, .5), 3),
           "ttfb_p99_ms": round(_pct(first, .99), 3), "rps": round(total / res.seconds, 1),
           "client_cpu_us_per_req": round(client / total * 1e6)}
    for k in procs:
        if before[k] is not None and after[k] is not None:
            rec[f"{k}_cpu_us_per_req"] = round((after[k] - before[k]) / total * 1e6)
    return rec


def _added(d: dict[str, Any], r: dict[str, Any]) -> None:
    r["added_p50_ms"] = round(r["p50_ms"] - d["p50_ms"], 3)
    r["added_p99_ms"] = round(r["p99_ms"] - d["p99_ms"], 3)
    r["added_ttfb_p99_ms"] = round(r["ttfb_p99_ms"] - d["ttfb_p99_ms"], 3)
    r["added_p99_ratio"] = round(r["p99_ms"] / d["p99_ms"], 2) if d["p99_ms"] else None


def _pair(args, tokens: int, itl_s: float):
    """(worker, router, worker port, router port): a lean worker and a router in front of it."""
    from pdsdk.ports import free_port

    wport, rport = free_port(), free_port()
    worker = spawn([sys.executable, "-m", "pdsdk.testing.lean_worker", "--port", str(wport), "--chunks",
                    str(tokens), "--token-delay", str(itl_s)], wport)
    try:
        argv = bench_peers.router_argv("pdsdk", rport, [f"http://127.0.0.1:{wport}"], args.policy, 1)
        router = spawn(argv, rport)
    except BaseException:
        worker.kill()
        raise
    time.sleep(0.3)  # first health check done
    return worker, router, wport, rport


def latency(args) -> list[dict[str, Any]]:
    out = []
    worker, router, wport, rport = _pair(args, args.tokens, 0.0)
    try:
        for streams in [int(s) for s in args.streams.split(",") if s]:
            total = max(400, streams * args.requests)
            d = _measure("direct", "saturated", wport, streams, total, args.tokens, {"worker": worker})
            r = _measure("router", "saturated", rport, streams, total, args.tokens,
                         {"worker": worker, "router": router})
            _added(d, r)
            out += [d, r]
    finally:
        stop(router, worker)
    if args.paced_streams > 0:
        worker, router, wport, rport = _pair(args, args.paced_tokens, args.paced_itl_ms / 1e3)
        try:
            n, spread = args.paced_streams, args.paced_tokens * args.paced_itl_ms / 1e3  # one answer's time
            d = _measure("direct", "paced", wport, n, n, args.paced_tokens, {"worker": worker}, spread)
            r = _measure("router", "paced", rport, n, n, args.paced_tokens, {"worker": worker, "router": router},
                         spread)
            _added(d, r)
            out += [d, r]
        finally:
            stop(router, worker)
    return out


def index_speeds(args) -> list[dict[str, Any]]:
    """The compiled index (16 blocks per event, as a prefill stores them; and 1 per event, as
    decode steps do) and, as its peer in the same run, the pure-Python one."""
    from pdsdk.router import kvindex

    compiled = kvindex._compiled
    out = [index_speed(args), index_speed(args, "kv_index_1_block_events", 1)] if compiled is not None else []
    kvindex._compiled = None
    try:
        out.append(index_speed(args, case="kv_index_python"))
    finally:
        kvindex._compiled = compiled
    return out


def index_speed(args, case: str = "kv_index", blocks_per_event: int = 16) -> dict[str, Any]:
    from pdsdk.testing import fake_kv_events as fe
    from pdsdk.router.kvindex import KVIndex
    from pdsdk.router.kvindex.wire import decode_batch

    bs, per_batch, sources = args.block_size, 16, 4
    prompt_blocks = 128  # 2048-token prompts
    payloads = []
    n = 0
    seq_id = 0
    while n < args.index_blocks:  # prompts of 128 blocks, published 16 blocks per batch, parents chained
        toks = list(range(seq_id * 100_000, seq_id * 100_000 + prompt_blocks * bs))
        hashes = fe.chain(toks, bs, salt=seq_id)
        for i in range(0, prompt_blocks, per_batch):
            events = [fe.stored("vllm", hashes[j:j + blocks_per_event], hashes[j - 1] if j else None,
                                toks[j * bs:(j + blocks_per_event) * bs], bs)
                      for j in range(i, i + per_batch, blocks_per_event)]
            payloads.append((f"src{seq_id % sources}", fe.encode_batch("vllm", events)))
            n += per_batch
        seq_id += 1
    wall, cpu = [], []
    for _ in range(3):  # best of 3 fresh indexes: the machine is shared, the minimum is the index's own speed
        idx = KVIndex()
        t0, c0 = time.perf_counter(), time.thread_time()
        for src, payload in payloads:
            idx.apply(src, decode_batch(payload)[1])
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    lookups = 2000
    probes = [list(range(i % seq_id * 100_000, i % seq_id * 100_000 + prompt_blocks * bs)) for i in range(lookups)]
    hits = 0
    t0 = time.perf_counter()
    for p in probes:
        hits += bool(idx.lookup(p))
    look = time.perf_counter() - t0
    if hits != lookups:
        raise AssertionError(f"only {hits} of {lookups} indexed prompts were found")
    return {"case": case, "mode": "", "streams": 0, "blocks": n, "block_size": bs,
            "blocks_per_event": blocks_per_event,
            "events_per_s": round(n / min(wall)), "events_per_cpu_s": round(n / min(cpu)),
            "lookups_per_s": round(lookups / look), "lookup_prompt_tokens": prompt_blocks * bs}


def _cpu_col(r: dict[str, Any]) -> str:
    v = r.get("router_cpu_us_per_req")
    return "" if v is None else str(v)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 180)
    if args.doc and not os.path.exists(args.doc):
        console.print(f"[red]--doc {args.doc}: no such file[/red]")
        return 2
    if args.peer is not None:
        records = bench_peers.compare(args, say=console.print)
        write_json(args.json_out, records)
        return bench_peers.report(args, records, console)
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    with console.status("router latency: direct vs routed..."):
        records = latency(args)
    if args.index_blocks > 0:
        with console.status("KV index: ingest and lookups..."):
            records += index_speeds(args)
    load1 = os.getloadavg() if hasattr(os, "getloadavg") else None
    for r in records:  # how busy the machine was with other work: these numbers are shared-core numbers
        r["loadavg_1m"] = [round(load0[0], 2), round(load1[0], 2)] if load0 and load1 else None
    load = f", load average {load0[0]:.1f} -> {load1[0]:.1f}" if load0 and load1 else ""
    table = Table(title=f"pdsdk bench router ({os.cpu_count()} cores, lean worker and client{load})")
    for col in ("case", "mode", "streams", "p50 ms", "p99 ms", "added p99 ms", "TTFB p99 ms", "added TTFB p99",
                "req/s", "router CPU us/req", "events/s (cpu)", "lookups/s"):
        table.add_column(col)
    for r in records:
        ev = f"{r['events_per_s']:,} ({r['events_per_cpu_s']:,})" if "events_per_s" in r else ""
        table.add_row(r["case"], r.get("mode", ""), str(r["streams"]), str(r.get("p50_ms", "")),
                      str(r.get("p99_ms", "")), str(r.get("added_p99_ms", "")), str(r.get("ttfb_p99_ms", "")),
                      str(r.get("added_ttfb_p99_ms", "")), str(r.get("rps", "")), _cpu_col(r), ev,
                      f"{r['lookups_per_s']:,}" if "lookups_per_s" in r else "")
    console.print(table)
    write_json(args.json_out, records)
    if args.doc:
        rows = []
        for r in records:
            case = r["case"] if r.get("mode") != "paced" else \
                f"{r['case']} paced ({r['tokens']} tok, {args.paced_itl_ms:g} ms apart)"
            added = ""
            if "added_p99_ms" in r:
                added = f"{r['added_p99_ms']} ({r['added_p99_ratio']}x direct)"
                if r.get("mode") == "paced":
                    added += f"; TTFB +{r['added_ttfb_p99_ms']}"
            rows.append([case, r["streams"], r.get("p50_ms", ""), r.get("p99_ms", ""), added, _cpu_col(r),
                         f"{r['events_per_s']:,} (cpu {r['events_per_cpu_s']:,})" if "events_per_s" in r else "",
                         f"{r['lookups_per_s']:,}" if "lookups_per_s" in r else ""])
        console.print(f"appended {len(rows)} rows to {append_rows(args.doc, SECTION, rows)}")
    return 0
