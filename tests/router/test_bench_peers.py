"""`pdsdk bench router --peer`: its options, the lean worker's answers to what the peer routers ask,
the load client's duration mode, process-tree CPU, the ratios, and small real runs (pdsdk's router
alone, then each installed peer)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
from helpers import REQUIRE_ALL, run_cli
from pdsdk.bench import router_clients as bench_clients, router_peers as bench_peers
from pdsdk.bench.router_procs import cpu_s, tree_cpu_s
from pdsdk.testing.lean_worker import LeanWorker, run_load

BODY = {"model": "fake-model", "prompt": "p", "max_tokens": 4, "stream": True}


async def _exchange(port: int, raw: bytes) -> bytes:
    """Sends raw bytes, returns all the worker answers until it closes (or 2 s pass)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(65536), 2)
    finally:
        writer.close()


def test_peer_names_are_checked():
    assert bench_peers.peer_list("vllm-router, sglang-router,vllm-router") == ["vllm-router", "sglang-router"]
    assert bench_peers.peer_list("none") == []
    out = run_cli("bench", "router", "--peer", "nginx")
    assert out.returncode == 2 and "unknown peer nginx" in out.stderr
    out = run_cli("bench", "router", "--peer", "none", "--duration", "0.5")
    assert out.returncode == 2 and "whole seconds" in out.stderr
    out = run_cli("bench", "router", "--peer", "none", "--processes", "2,0")
    assert out.returncode == 2 and "processes >= 1 expected, got '0'" in out.stderr


def test_processes_always_said_to_a_router_that_has_the_option(monkeypatch):
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    monkeypatch.setattr(bench_peers, "pdsdk_router_has_processes", lambda: True)
    assert bench_peers.router_argv("pdsdk", 9, urls, "round_robin", 1)[-2:] == ["--processes", "1"]
    assert bench_peers.router_argv("pdsdk", 9, urls, "round_robin", 4)[-2:] == ["--processes", "4"]
    monkeypatch.setattr(bench_peers, "pdsdk_router_has_processes", lambda: False)
    one = bench_peers.router_argv("pdsdk", 9, urls, "round_robin", 1)
    assert "--processes" not in one and one.count("--worker") == 2
    assert "no --processes" in bench_peers.router_argv("pdsdk", 9, urls, "round_robin", 4)


def test_ratios_to_the_best_peer_at_each_level():
    recs = [{"router": "pdsdk", "connections": 50, "rps": 900.0, "p99_ms": 20.0},
            {"router": "vllm-router", "connections": 50, "rps": 1000.0, "p99_ms": 10.0},
            {"router": "sglang-router", "connections": 50, "rps": 500.0, "p99_ms": 5.0},
            {"router": "pdsdk", "connections": 1, "rps": 10.0, "p99_ms": 1.0},
            {"router": "sglang-router", "skipped": "not installed"}]
    bench_peers.add_ratios(recs)
    assert [r.get("ratio_to_best_peer") for r in recs] == [0.9, 1.0, 0.5, None, None]
    assert recs[0]["p99_ratio_to_best_peer"] == 2.0 and recs[2]["p99_ratio_to_best_peer"] == 0.5


def test_rounds_median_and_paired_ratios():
    def rounds(router, rps, p99):
        return bench_peers._median_round([{"router": router, "connections": 50, "rps": x, "p99_ms": y}
                                          for x, y in zip(rps, p99)])

    # The machine slowed down during pdsdk's turn in round 3: the median rounds (900 and 1222.2) say
    # 0.74, the rounds' own ratios say 0.9, 0.9 and 0.36, and their median stands.
    recs = [rounds("pdsdk", [900, 1100, 450], [10, 10, 40]), rounds("vllm-router", [1000, 1222.2, 1250], [5, 5, 5])]
    assert recs[0]["rps"] == 900 and recs[0]["rounds_rps"] == [900, 1100, 450] and recs[1]["rps"] == 1222.2
    bench_peers.add_ratios(recs)
    assert recs[0]["ratio_to_best_peer"] == 0.9 and recs[0]["p99_ratio_to_best_peer"] == 2.0
    assert recs[1]["ratio_to_best_peer"] == 1.0


def test_lean_worker_answers_what_sglang_router_asks_and_refuses_garbage():
    async def main():
        w = await LeanWorker(chunks=2).start()
        try:
            for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/v1/models"):
                got = await _exchange(w.port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                assert got.startswith(b"HTTP/1.1 200 OK") and json.loads(got.split(b"\r\n\r\n", 1)[1]), path
            # sglang-router probes every worker for gRPC: an HTTP/2 preface gets a 400 and a close
            got = await _exchange(w.port, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            assert got.startswith(b"HTTP/1.1 400")
            for length in (b"99999999", b"-1", b"\xb2"):  # too large, negative, latin-1 "²" (int() refuses it)
                head = b"POST /v1/completions HTTP/1.1\r\nContent-Length: %s\r\n\r\n" % length
                got = await _exchange(w.port, head)
                assert got.startswith(b"HTTP/1.1 400") and b"content-length" in got, length
            bad = b'{"max_tokens": "many", "stream": true}'
            got = await _exchange(w.port, b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s"
                                  % (len(bad), bad))
            assert got.startswith(b"HTTP/1.1 400") and b"max_tokens" in got
            assert w.served == 0
            res = await run_load("127.0.0.1", w.port, 2, 4, BODY)  # and it still serves
            assert len(res.latency) == 4 and w.served == 6
        finally:
            await w.stop()
    asyncio.run(main())


def test_load_for_a_duration_counts_errors_and_goes_on():
    async def main():
        w = await LeanWorker(chunks=2).start()
        try:
            t0 = time.perf_counter()
            res = await run_load("127.0.0.1", w.port, 3, None, BODY, duration_s=0.5)
            assert 0.5 <= time.perf_counter() - t0 < 3 and len(res.latency) > 10 and not res.errors
            res = await run_load("127.0.0.1", w.port, 2, 6, BODY, path="/nowhere", count_errors=True)
            assert res.errors == 2 + 6 and not res.latency  # the two warm-up requests too
        finally:
            await w.stop()
    asyncio.run(main())


_BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.25: pass\n"
_PARENT = f"""
import subprocess, sys
subprocess.run([sys.executable, "-c", {_BUSY!r}])
live = subprocess.Popen([sys.executable, "-c", {_BUSY!r} + "print(1, flush=True); input()"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
live.stdout.readline()
print("done", flush=True)
input()
live.stdin.close()
live.wait()
"""


def test_tree_cpu_counts_every_descendant_live_or_reaped():
    p = subprocess.Popen([sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"done\n"
        assert tree_cpu_s(p.pid) >= 0.5 and cpu_s(p.pid) < 0.25
    finally:
        p.stdin.close()
        p.wait(10)
    assert tree_cpu_s(p.pid) is None


def _args(**kw):
    import argparse

    base = {"streams": "1,4", "tokens": 4, "policy": "round_robin", "workers": 2, "duration": 1, "warmup": 0,
            "client": "python", "client_threads": 1, "processes": [1], "peer": [], "rounds": 1}
    return argparse.Namespace(**{**base, **kw})


def _check(recs, name, levels):
    rows = [r for r in recs if r["router"] == name]
    assert [r["connections"] for r in rows] == levels, recs
    for r in rows:
        assert r["requests"] > 10 and r["rps"] > 0 and r["errors"] == 0 and r["p99_ms"] >= r["p50_ms"] > 0, r
        assert r["cpu_us_per_req"] > 0 and r["client_cpu_us_per_req"] > 0, r
        assert r["workers_cpu_us_per_req"] is not None, r  # may be 0: /proc counts 10 ms ticks
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("client", ["python", "wrk"])
def test_pdsdk_router_alone(client):
    if client == "wrk" and bench_clients.wrk_path() is None:
        (pytest.fail if REQUIRE_ALL else pytest.skip)("wrk is not installed (apt-get install wrk)")
    recs = bench_peers.compare(_args(client=client), say=lambda *_: None)
    for r in _check(recs, "pdsdk", [1, 4]):
        assert r["client"] == client and r["processes"] == 1 and r["ratio_to_best_peer"] is None


@pytest.mark.slow
def test_pdsdk_router_at_several_process_counts():
    recs = bench_peers.compare(_args(streams="4", processes=[1, 2]), say=lambda *_: None)
    assert [r["processes"] for r in _check(recs, "pdsdk", [4, 4])] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("peer", bench_peers.PEERS)
def test_peer_in_the_same_run(peer):
    why = bench_peers.router_argv(peer, 1, [], "round_robin", 1)
    if isinstance(why, str):
        (pytest.fail if REQUIRE_ALL else pytest.skip)(why)
    recs = bench_peers.compare(_args(streams="2", peer=[peer], rounds=2), say=lambda *_: None)
    (mine,) = _check(recs, "pdsdk", [2])
    (row,) = _check(recs, peer, [2])
    assert row["ratio_to_best_peer"] == 1.0 and row["version"]
    assert len(mine["rounds_rps"]) == len(row["rounds_rps"]) == 2 and mine["rps"] in mine["rounds_rps"]
