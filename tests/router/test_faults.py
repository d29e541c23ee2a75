"""Faults: a worker killed mid-stream, a hanging worker, failing workers and breakers, the client
going away (both workers cancelled), deadlines."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import pytest

from pdsdk.ports import free_port
from pdsdk.router.workers import Worker
from pdsdk.testing.router_harness import Harness, eventually

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 50}


def run(coro):
    return asyncio.run(coro)


async def _wait_http(url: str, timeout: float = 15.0) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(int(timeout / 0.05)):
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(url)


def test_worker_killed_mid_stream_then_traffic_moves_on():
    async def main():
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "pdsdk.testing.fake_worker", "--port", str(port),
                                 "--chunks", "50", "--token-delay", "0.05"], cwd="/")  # not the tree: the install
        try:
            await _wait_http(f"http://127.0.0.1:{port}")
            async with Harness(plain=1, breaker_threshold=1) as h:
                local = h.router.pool.workers[h.plain[0].url]
                local.draining = True  # first request must land on the process we kill
                h.router.add_worker(Worker(f"http://127.0.0.1:{port}", source="admin"))
                got = b""
                async with h.session.post(h.url + "/v1/completions", json={**BODY, "stream": True}) as r:
                    assert r.status == 200
                    async for chunk in r.content.iter_any():
                        got += chunk
                        if got.count(b"data: ") >= 2 and proc.poll() is None:  # chunks may coalesce
                            proc.kill()
                assert b"worker failed mid-stream" in got and b"tok1" in got, got[-300:]
                local.draining = False
                for _ in range(3):  # the dead worker's breaker is open: no client sees it
                    status, out, _ = await h.post("/v1/completions", BODY)
                    assert status == 200, out
        finally:
            proc.kill()
            proc.wait()
    run(main())


def test_a_stream_cut_mid_way_ends_with_an_error_event_then_done_and_is_counted():
    openai = pytest.importorskip("openai")

    async def main():
        async with Harness(plain=1, worker_opts={"chunks": 8}) as h:
            h.plain[0].die_after = 2
            _, before = await h.get("/metrics")
            status, out, _ = await h.post("/v1/completions", {**BODY, "max_tokens": 8, "stream": True})
            assert status == 200 and "tok1" in out and "tok2" not in out, out
            assert out.endswith('"code": 502}}\n\ndata: [DONE]\n\n') and "worker failed mid-stream" in out, out
            client = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="none", max_retries=0)
            got = []
            with pytest.raises(openai.APIError, match="worker failed mid-stream"):
                async for chunk in await client.completions.create(model="fake-model", prompt="hi", max_tokens=8,
                                                                   stream=True):
                    got.append(chunk.choices[0].text)
            await client.close()
            assert got == ["tok0 ", "tok1 "]
            _, after = await h.get("/metrics")
            cut = 'pdsdk_router_stream_cut_total{reason="worker_failed"}'
            assert _counter(after, cut) - _counter(before, cut) == 2
    run(main())


def _counter(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + " "))


def test_a_decode_dying_before_its_first_token_is_retried_on_another():
    """The dead decode's connection closes after its head, before any token: nothing reached the
    client, so the router retries on a new pair and the client sees one whole stream."""
    async def main():
        async with Harness("vllm", prefill=1, decode=2, policy="round_robin", worker_opts={"chunks": 4}) as h:
            h.decode[0].die_after = 0
            for _ in range(4):
                status, out, _ = await h.post("/v1/completions", {**BODY, "stream": True})
                assert status == 200 and "tok3" in out and "error" not in out and out.endswith("data: [DONE]\n\n")
            assert h.decode[0].requests and len(h.decode[1].completed) == 4
    run(main())


def test_hanging_worker_is_skipped_after_first_token_timeout():
    async def main():
        async with Harness(plain=2, policy="round_robin", first_token_timeout_s=0.3, breaker_threshold=2) as h:
            h.plain[0].hang = True
            for _ in range(6):
                status, out, _ = await h.post("/v1/completions", {**BODY, "stream": True})
                assert status == 200 and "tok3" in out
            hung = h.router.pool.workers[h.plain[0].url]
            assert hung.breaker.state == "open"
            assert len(h.plain[0].requests) == 2  # two strikes, then the breaker kept it out
            _, metrics = await h.get("/metrics")
            assert "pdsdk_router_retries_total" in metrics
    run(main())


def test_failing_decode_retried_on_new_pair_and_breaker_recovers():
    async def main():
        async with Harness("vllm", prefill=1, decode=2, policy="round_robin", breaker_threshold=2,
                           breaker_cooldown_s=0.3) as h:
            bad = h.decode[0]
            bad.fail_status = 500
            for _ in range(5):
                status, out, _ = await h.post("/v1/completions", BODY)
                assert status == 200, out
            w = h.router.pool.workers[bad.url]
            assert w.breaker.state == "open" and len(bad.requests) == 2
            bad.fail_status = None
            await asyncio.sleep(0.35)  # cooldown over: one trial request, which succeeds
            for _ in range(4):
                assert (await h.post("/v1/completions", BODY))[0] == 200
            assert w.breaker.state == "closed" and len(bad.requests) > 2
    run(main())


def test_vllm_decode_serves_alone_when_every_prefill_fails():
    """A failed prefill is retried on another; with none left, the vLLM decode worker prefills itself
    (SGLang's decode server cannot, so there the request fails with 502)."""
    async def main():
        async with Harness("vllm", prefill=2, decode=1, policy="round_robin", retries=3) as h:
            for p in h.prefill:
                p.fail_status = 500
            status, out, _ = await h.post("/v1/completions", BODY)
            assert status == 200, out
            assert all(len(p.requests) == 1 for p in h.prefill)  # each tried once, then decode alone
            assert "kv_transfer_params" not in h.decode[0].requests[-1]["body"]
            _, metrics = await h.get("/metrics")
            assert 'pdsdk_router_local_prefill_total{reason="no_prefill"} 1.0' in metrics
        async with Harness("sglang", prefill=1, decode=1, retries=1) as h:
            h.prefill[0].fail_status = 500
            assert (await h.post("/v1/completions", BODY))[0] == 502
    run(main())


def test_client_error_is_not_retried():
    async def main():
        async with Harness(plain=2, policy="round_robin") as h:
            h.plain[0].fail_status = 400
            h.plain[1].fail_status = 400
            status, _, _ = await h.post("/v1/completions", BODY)
            assert status == 400 and sum(len(w.requests) for w in h.plain) == 1
    run(main())


async def _disconnect_after_first_chunk(h: Harness) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(h.url + "/v1/completions", json={**BODY, "stream": True}) as r:
            assert r.status == 200
            await r.content.readany()
        # leaving the block closes the connection mid-stream


def test_client_disconnect_cancels_both_sglang_workers():
    async def main():
        async with Harness("sglang", prefill=1, decode=1, worker_opts={"token_delay_s": 0.05}) as h:
            await _disconnect_after_first_chunk(h)
            assert await eventually(lambda: h.decode[0].cancelled and h.prefill[0].cancelled)
            assert await eventually(lambda: all(w.inflight == 0 for w in h.router.pool.workers.values()))
    run(main())


def test_client_disconnect_during_vllm_prefill_and_decode():
    async def main():
        async with Harness("vllm", prefill=1, decode=1, worker_opts={"token_delay_s": 0.05}) as h:
            await _disconnect_after_first_chunk(h)  # during decode
            assert await eventually(lambda: h.decode[0].cancelled)
            h.prefill[0].hang = True  # during prefill
            async with aiohttp.ClientSession() as s:
                try:
                    async with s.post(h.url + "/v1/completions", json={**BODY, "stream": True},
                                      timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                        await r.read()
                except asyncio.TimeoutError:
                    pass
            assert await eventually(lambda: h.prefill[0].cancelled)
            assert await eventually(lambda: all(w.inflight == 0 for w in h.router.pool.workers.values()))
    run(main())


def test_deadline_ends_a_stream_with_an_error_event():
    async def main():
        async with Harness(plain=1, worker_opts={"chunks": 50, "token_delay_s": 0.05}) as h:
            status, out, _ = await h.post("/v1/completions", {**BODY, "stream": True},
                                          headers={"X-Request-Timeout": "0.4"})
            assert status == 200 and "deadline" in out and "tok1" in out and "tok40" not in out
            h.plain[0].hang = True
            status, out, _ = await h.post("/v1/completions", BODY, headers={"X-Request-Timeout": "0.3"})
            assert status in (502, 504)
    run(main())


def test_a_client_leaving_before_the_body_ends_is_no_server_error(monkeypatch, caplog):
    """Seen on the GPU matrix: a load client closed its connection after the last event, before the
    chunked body's end; aiohttp logged the router's write of that end as 'Error handling request'."""
    from aiohttp import web
    from aiohttp.client_exceptions import ClientConnectionResetError

    real = web.StreamResponse.write_eof

    async def gone(self, data=b""):
        if sys._getframe(1).f_code.co_name == "relay":  # the router's answer, not the test worker's
            raise ClientConnectionResetError("Cannot write to closing transport")
        await real(self, data)

    async def main():
        async with Harness(plain=1) as h:
            monkeypatch.setattr(web.StreamResponse, "write_eof", gone)
            async with aiohttp.ClientSession() as s:
                async with s.post(h.url + "/v1/completions", json={**BODY, "stream": True}) as r:
                    try:
                        await r.read()  # the body never ends properly
                    except aiohttp.ClientPayloadError:
                        pass
            _, metrics = await h.get("/metrics")
            assert 'code="500"' not in metrics
    run(main())
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
