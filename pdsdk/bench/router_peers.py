"""`pdsdk bench router --peer ...`: pdsdk's router and its Rust peers (vllm-router, sglang-router)
in front of the same lean streaming workers, at the same connection counts, in one run.

Every router sits in front of the same --workers lean workers (pdsdk/testing/lean_worker.py, one process
each), round robin by default. Per level, the routers take turns (--rounds times) at a closed loop of N
keep-alive connections for --duration seconds from wrk or the lean Python client (router_clients.py). Recorded per
(router, connections): requests/s, p50/p99 latency of the whole streamed answer, the CPU time
of the router's whole process tree per request (/proc), errors, and the ratio to the best peer's
requests/s (and p99) at the same level. A peer that is not installed is skipped, with the reason
in its record.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pdsdk.bench import router_clients as bench_clients
from pdsdk.bench.router_procs import cpu_s, spawn, stop, tree_cpu_s, wait_answering

PEERS = ("vllm-router", "sglang-router")
SECTION = "Router and its peers (`pdsdk bench router --peer`)"
INSTALL_HINT = "pip install 'pdsdk[bench-peers]'"


def peer_list(text: str) -> list[str]:
    """argparse type of --peer: names from PEERS, comma-separated; 'none' runs pdsdk alone."""
    names = [n.strip() for n in text.split(",") if n.strip() and n.strip() != "none"]
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        known = ", ".join(PEERS)
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(unknown)}; known: {known}, none")
    return list(dict.fromkeys(names))


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _vllm_router_exe() -> str | None:
    beside = Path(sys.executable).parent / "vllm-router"  # this venv's, before any on PATH
    return str(beside) if beside.exists() else shutil.which("vllm-router")


@functools.cache
def pdsdk_router_has_processes() -> bool:
    out = subprocess.run([sys.executable, "-m", "pdsdk", "router", "--help"], capture_output=True, text=True,
                         timeout=60, cwd="/", check=False)
    return "--processes" in out.stdout


def router_argv(name: str, port: int, workers: list[str], policy: str, processes: int) -> list[str] | str:
    """The command line that starts router `name` on `port`, or why it cannot start here."""
    from pdsdk.ports import free_port

    if name == "pdsdk":
        argv = [sys.executable, "-m", "pdsdk", "router", "--port", str(port), "--policy", policy]
        for w in workers:
            argv += ["--worker", w]
        if pdsdk_router_has_processes():  # always said: its default is not 1 process
            return argv + ["--processes", str(processes)]
        return argv if processes == 1 else "this pdsdk router has no --processes: run it with --processes 1"
    # Both peers: loopback only, a metrics port of their own (two on the default 29000 collide),
    # warnings only (as quiet as pdsdk's router, which logs no line per request).
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy,
              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if name == "vllm-router":
        exe = _vllm_router_exe()
        if exe is None:
            return f"vllm-router is not installed ({INSTALL_HINT})"
        return [exe, *common, "--log-level", "warning"]
    if name == "sglang-router":
        if importlib.util.find_spec("sglang_router") is None:
            return f"sglang-router is not installed ({INSTALL_HINT})"
        return [sys.executable, "-m", "sglang_router.launch_router", *common, "--log-level", "warn",
                "--shutdown-grace-period-secs", "1"]
    raise ValueError(f"unknown router {name}")


def _version_of(name: str) -> str | None:
    if name == "pdsdk":
        from pdsdk._version import __version__

        return __version__
    return _version(name)


def _load(args, port: int, connections: int, seconds: int, body: dict) -> bench_clients.Load:
    if args.client == "wrk":
        return bench_clients.run_wrk(port, connections, seconds, body, args.client_threads)
    return bench_clients.run_python(port, connections, seconds, body)


def _measure(args, name: str, processes: int, router: subprocess.Popen, port: int, connections: int,
             workers: list[subprocess.Popen], body: dict) -> dict[str, Any]:
    if args.warmup > 0:
        _load(args, port, connections, args.warmup, body)
    load0 = os.getloadavg()[0]
    r0, w0 = tree_cpu_s(router.pid), [cpu_s(w.pid) for w in workers]
    res = _load(args, port, connections, args.duration, body)
    r1, w1 = tree_cpu_s(router.pid), [cpu_s(w.pid) for w in workers]
    n = max(res.requests, 1)
    rec = {"router": name, "version": _version_of(name), "processes": processes,
           "connections": connections, "rps": round(res.requests / res.seconds, 1) if res.seconds else 0.0,
           "p50_ms": round(res.p50_ms, 3), "p99_ms": round(res.p99_ms, 3),
           "cpu_us_per_req": round((r1 - r0) / n * 1e6) if r0 is not None and r1 is not None else None,
           "errors": res.errors, "ratio_to_best_peer": None, "p99_ratio_to_best_peer": None,
           "client": args.client, "client_cpu_us_per_req": round(res.client_cpu_s / n * 1e6),
           "workers_cpu_us_per_req": None, "requests": res.requests, "seconds": round(res.seconds, 3),
           "workers": len(workers), "tokens": args.tokens, "policy": args.policy, "cores": os.cpu_count(),
           "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    if None not in w0 and None not in w1:
        rec["workers_cpu_us_per_req"] = round((sum(w1) - sum(w0)) / n * 1e6)
    return rec


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Each measured row's requests/s and p99 over the best peer's at the same connections. With
    rounds, each ratio is the median of the rounds' own ratios: each round's pair ran back to back,
    so the machine's slow spells cancel out."""
    best: dict[int, dict[str, Any]] = {}
    for r in records:
        if r["router"] in PEERS and "rps" in r and r["rps"] > best.get(r["connections"], {"rps": 0})["rps"]:
            best[r["connections"]] = r
    for r in records:
        b = best.get(r.get("connections"))
        if b is not None and "rps" in r:
            r["ratio_to_best_peer"] = round(r["rps"] / b["rps"], 3)
            r["p99_ratio_to_best_peer"] = round(r["p99_ms"] / b["p99_ms"], 3) if b["p99_ms"] else None
            for key, rounds in (("ratio_to_best_peer", "rounds_rps"), ("p99_ratio_to_best_peer", "rounds_p99_ms")):
                paired = [x / y for x, y in zip(r.get(rounds, []), b.get(rounds, [])) if y]
                if len(paired) > 1:
                    r[key] = round(statistics.median(paired), 3)


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round of median requests/s stands for the level; every round's requests/s is kept beside it."""
    rec = sorted(rounds, key=lambda r: r["rps"])[(len(rounds) - 1) // 2]
    if len(rounds) == 1:
        return rec
    return {**rec, "rounds_rps": [r["rps"] for r in rounds], "rounds_p99_ms": [r["p99_ms"] for r in rounds]}


def compare(args, say=print) -> list[dict[str, Any]]:
    """pdsdk's router and each of args.peer in front of the same workers. Every router is started
    first; then per level they take turns, --rounds times, so a noisy machine's slow spells fall on
    each of them alike, and the median round stands for each."""
    from pdsdk.ports import free_port

    levels = [int(s) for s in args.streams.split(",") if s]
    body = {"model": "fake-model", "prompt": "benchmark prompt " * 16, "max_tokens": args.tokens,
            "stream": True}
    probe = json.dumps({**body, "stream": False}).encode()
    logs = tempfile.mkdtemp(prefix="pdsdk-bench-router-")
    workers, urls, routers = [], [], {}
    records: list[dict[str, Any]] = []
    try:
        for i in range(args.workers):
            port = free_port()
            worker = [sys.executable, "-m", "pdsdk.testing.lean_worker", "--port", str(port),
                      "--chunks", str(args.tokens)]
            workers.append(spawn(worker, port, log=f"{logs}/worker{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        for name, processes in [("pdsdk", n) for n in args.processes] + [(peer, 1) for peer in args.peer]:
            port = free_port()
            argv = router_argv(name, port, urls, args.policy, processes)
            if isinstance(argv, str):
                say(f"skipped {name}: {argv}")
                records.append({"router": name, "skipped": argv})
                continue
            router = spawn(argv, port, timeout_s=60, log=f"{logs}/{name}-{processes}.log")
            routers[name, processes] = (router, port)
            wait_answering(port, probe, router)
        for connections in levels:
            rounds: dict[tuple[str, int], list[dict[str, Any]]] = {key: [] for key in routers}
            for i in range(args.rounds):
                for (name, processes), (router, port) in routers.items():
                    say(f"{name}{f' x{processes}' if name == 'pdsdk' else ''}: {connections} connections, "
                        f"{args.duration} s ({args.client})" + (f", round {i + 1}/{args.rounds}" if args.rounds > 1 else ""))
                    rounds[name, processes].append(_measure(args, name, processes, router, port, connections, workers,
                                                            body))
            records += [_median_round(rs) for rs in rounds.values()]
    finally:
        stop(*(router for router, _ in routers.values()), *workers)
    shutil.rmtree(logs, ignore_errors=True)  # kept when a run failed: the error names its log
    add_ratios(records)
    return records


def _cell(v: Any) -> str:
    if v is None:
        return ""
    return f"{v:,}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def report(args, records: list[dict[str, Any]], console) -> int:
    """The table on the console and, with --doc, rows in its section; the exit code."""
    from rich.table import Table

    from pdsdk.bench.log import append_rows

    loads = [x for r in records for x in r.get("loadavg_1m", [])]
    load = f", load average {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    table = Table(title=f"pdsdk bench router --peer ({os.cpu_count()} cores, {args.workers} lean workers, "
                        f"client {args.client}{load})")
    cols = ("router", "version", "processes", "connections", "rps", "p50_ms", "p99_ms", "cpu_us_per_req",
            "errors", "ratio_to_best_peer", "p99_ratio_to_best_peer", "client_cpu_us_per_req")
    for c in cols:
        table.add_column(c.replace("_", " "))
    for r in records:
        table.add_row(*[_cell(r.get(c)) if c != "version" or "skipped" not in r else "skipped" for c in cols])
    console.print(table)
    if args.doc:
        rows = [[f"{r['router']} {r['version']}", r["processes"], r["connections"], _cell(r["rps"]),
                 r["p50_ms"], r["p99_ms"], _cell(r["cpu_us_per_req"]), r["errors"],
                 _cell(r["ratio_to_best_peer"]), _cell(r["p99_ratio_to_best_peer"]),
                 f"{r['client']}, {r['workers']} workers, {len(r.get('rounds_rps', [0]))} rounds"]
                for r in records if "rps" in r]
        try:
            console.print(f"appended {len(rows)} rows to {append_rows(args.doc, SECTION, rows)}")
        except ValueError as e:
            console.print(f"[red]{e}[/red]")
            return 2
    return 0
