"""`pdsdk bench serve` and `pdsdk bench compare` against the router's OpenAI-compatible test worker."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
from helpers import eventually, run_cli

from pdsdk.matrix.loadgen import LoadOptions, run_load, summarize
from pdsdk.matrix.workload import AgentSpec, Workload, random_requests
from pdsdk.ports import free_port
from pdsdk.testing.fake_worker import FakeWorker
from pdsdk.testing.router_harness import Harness


async def _load(workload: Workload, **opts):
    worker = await FakeWorker(chunks=8).start()
    try:
        results, wall, model = await run_load(LoadOptions(worker.url, warmup=0, **opts), workload)
    finally:
        await worker.stop()
    return worker, results, wall, model


def test_random_prompts_have_exact_lengths_and_no_shared_prefix():
    reqs = random_requests(Workload("random", num_prompts=20, isl=300, osl=7, vocab=500, seed=3))
    assert all(len(r.prompt) == 300 and r.max_tokens == 7 for r in reqs)
    assert all(10 <= t < 500 for r in reqs for t in r.prompt)
    assert len({r.prompt[0] for r in reqs}) == 20
    assert random_requests(Workload("random", num_prompts=20, isl=300, osl=7, vocab=500, seed=3))[5].prompt == \
        reqs[5].prompt  # seeded: two runs send the same bytes


def test_random_load_measures_every_request():
    worker, results, wall, model = asyncio.run(_load(Workload("random", num_prompts=12, isl=50, osl=8)))
    assert model == "fake-model" and len(results) == 12 and all(r.ok for r in results)
    bodies = [r["body"] for r in worker.requests]
    assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 8 and len(b["prompt"]) == 50 for b in bodies)
    s = summarize(results, wall)
    assert s["completed"] == 12 and s["errors"] == 0
    assert s["output_tokens"] == sum(r.output_tokens for r in results) > 0
    assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]


def test_agent_sessions_grow_their_history_and_share_the_system_prompt():
    agent = AgentSpec(sessions=3, turns=3, system=200, user=10, tool_result=20, reasoning=5, gap_s=0.01)
    worker, results, _, _ = asyncio.run(_load(Workload("agent", osl=4, vocab=800, agent=agent)))
    assert len(results) == 9 and all(r.ok for r in results)
    by_session: dict[str, list[list[int]]] = {}
    for req in worker.requests:
        by_session.setdefault(req["headers"]["x-pdsdk-session"], []).append(req["body"]["prompt"])
    assert len(by_session) == 3
    systems = {tuple(p[0][:200]) for p in by_session.values()}
    assert len(systems) == 1  # one shared system prompt + tools
    for prompts in by_session.values():
        assert [len(p) for p in prompts] == [210, 234, 258]  # + answer (4) + tool result (20) per turn
        assert all(b[:len(a)] == a for a, b in zip(prompts, prompts[1:]))  # each turn extends the last
    assert all(r["body"]["max_tokens"] == 9 for r in worker.requests)  # reasoning + answer


def test_poisson_rate_spreads_arrivals():
    _, results, wall, _ = asyncio.run(_load(Workload("random", num_prompts=10, isl=20, osl=2), rate=20.0))
    starts = sorted(r.start_s for r in results)
    assert starts[-1] > 0.1  # ~0.45 s expected at 20/s; all at once would be ~0
    _, burst, _, _ = asyncio.run(_load(Workload("random", num_prompts=10, isl=20, osl=2)))
    assert max(r.start_s for r in burst) < starts[-1]


def test_concurrency_cap_is_honoured():
    async def go():
        worker = await FakeWorker(chunks=4, token_delay_s=0.02).start()
        seen, peak = 0, 0
        orig = worker._stream

        async def counting(*a, **k):
            nonlocal seen, peak
            seen += 1
            peak = max(peak, seen)
            try:
                return await orig(*a, **k)
            finally:
                seen -= 1
        worker._stream = counting
        try:
            await run_load(LoadOptions(worker.url, warmup=0, concurrency=2), Workload("random", num_prompts=8,
                                                                                       isl=10, osl=4))
        finally:
            await worker.stop()
        return peak
    assert asyncio.run(go()) == 2


def test_failures_are_counted_with_their_reason():
    async def go():
        worker = await FakeWorker().start()
        worker.fail_status = 503
        try:
            return await run_load(LoadOptions(worker.url, warmup=0), Workload("random", num_prompts=3, isl=10, osl=2))
        finally:
            await worker.stop()
    results, wall, _ = asyncio.run(go())
    s = summarize(results, wall)
    assert s["errors"] == 3 and "HTTP 503" in s["error_reasons"][0]


def test_a_stream_ended_by_an_error_event_is_a_failure_after_its_first_token():
    async def go():
        async with Harness(plain=1, worker_opts={"chunks": 8}) as h:
            h.plain[0].die_after = 3  # the worker's connection breaks: the router ends the stream with an error
            return await run_load(LoadOptions(h.url, "fake-model", warmup=0),
                                  Workload("random", num_prompts=2, isl=10, osl=8))
    results, _, _ = asyncio.run(go())
    assert all(not r.ok and r.ttft_s > 0 and "error event: worker failed mid-stream" in r.error for r in results)


def test_retries_send_again_what_no_server_took():
    async def go():
        port = free_port()
        worker = FakeWorker(chunks=2)
        late = asyncio.get_running_loop().call_later(0.2, lambda: asyncio.ensure_future(worker.start(port=port)))
        try:
            return await run_load(LoadOptions(f"http://127.0.0.1:{port}", "fake-model", warmup=0, retries=2),
                                  Workload("random", num_prompts=1, isl=10, osl=2))
        finally:
            late.cancel()
            await worker.stop()
    results, _, _ = asyncio.run(go())
    assert results[0].ok and results[0].retries >= 1, results[0]


@pytest.fixture
def worker_process():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "pdsdk.testing.fake_worker", "--port", str(port), "--chunks", "6"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import urllib.request

    def up():
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200
        except OSError:
            return False
    assert eventually(up, 20)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def test_cli_json_doc_row_and_compare(worker_process, tmp_path):
    doc = tmp_path / "bench.md"
    doc.write_text("# B\n\n## Serving (`pdsdk bench serve`)\n\n| date | machine | a |\n|---|---|---|\n")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    r = run_cli("bench", "serve", "--url", worker_process, "--num-prompts", "5", "--isl", "30", "--osl", "6",
                "--label", "plain", "--json", str(a), "--doc", str(doc), "--quiet")
    assert r.returncode == 0, r.stderr
    rec = json.loads(a.read_text())
    assert rec["kind"] == "pdsdk-bench-serve" and rec["summary"]["completed"] == 5 and len(rec["requests"]) == 5
    assert "| plain | random: 5 prompts, ISL 30 / OSL 6 |" in doc.read_text()
    r = run_cli("bench", "serve", "--url", worker_process, "--workload", "agent", "--sessions", "2", "--turns", "2",
                "--tool-gap", "0", "--system-tokens", "64", "--label", "agent", "--json", str(b), "--quiet")
    assert r.returncode == 0, r.stderr
    assert set(json.loads(b.read_text())["summary"]["ttft_ms_by_turn"]) == {"1", "2"}
    r = run_cli("bench", "compare", str(a), str(b))
    assert r.returncode == 0 and "TTFT mean ms" in r.stdout and "plain" in r.stdout and "agent" in r.stdout


def test_cli_errors_name_the_option(tmp_path):
    r = run_cli("bench", "serve", "--url", "http://127.0.0.1:9", "--isl", "0")
    assert r.returncode == 2 and "--isl: must be at least 1" in r.stderr
    (tmp_path / "x.json").write_text("{}")
    r = run_cli("bench", "compare", str(tmp_path / "x.json"))
    assert r.returncode == 2 and ": is not a `pdsdk bench serve --json` result" in r.stderr


def test_unreachable_endpoint_is_a_clear_error():
    start = time.monotonic()
    r = run_cli("bench", "serve", "--url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2", "--quiet")
    assert r.returncode != 0 and time.monotonic() - start < 60
    assert "127.0.0.1" in r.stderr and "Traceback" not in r.stderr
