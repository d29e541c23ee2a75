"""The router's HTTP surface: errors, keys, admin API, models, health, metrics, streaming, openai client."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdsdk.testing.router_harness import Harness, eventually

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 3}


def run(coro):
    return asyncio.run(coro)


def test_bad_input_errors():
    async def main():
        async with Harness(plain=1, max_body_bytes=1000) as h:
            status, out, _ = await h.post("/v1/completions", raw=b'{"model": "fake-model", "prompt": ')
            assert status == 400 and "malformed JSON" in out["error"]["message"]
            status, out, _ = await h.post("/v1/completions", raw=b"[1, 2]")
            assert status == 400 and "JSON object" in out["error"]["message"]
            status, out, _ = await h.post("/v1/chat/completions", {"model": "fake-model", "messages": []})
            assert status == 400 and "messages" in out["error"]["message"]
            status, out, _ = await h.post("/v1/completions", {**BODY, "pdsdk": {"bogus": 1}})
            assert status == 400 and "bogus" in out["error"]["message"]
            status, out, _ = await h.post("/v1/completions", {**BODY, "model": "nope"})
            assert status == 404 and "fake-model" in out["error"]["message"]
            status, out, _ = await h.post("/v1/completions", {**BODY, "prompt": "x" * 2000})
            assert status == 413
    run(main())


def test_no_healthy_worker_is_503_with_retry_after():
    async def main():
        async with Harness(plain=1, retry_after_s=3) as h:
            h.plain[0].healthy = False
            await eventually(lambda: not h.router.pool.workers[h.plain[0].url].healthy)
            status, out, headers = await h.post("/v1/completions", BODY)
            assert status == 503 and headers["retry-after"] == "3"
            status, _ = await h.get("/health")
            assert status == 503
            h.plain[0].healthy = True
            assert await eventually(lambda: h.router.pool.workers[h.plain[0].url].healthy)
            status, _, _ = await h.post("/v1/completions", BODY)
            assert status == 200
    run(main())


def test_api_key_and_separate_admin_key():
    async def main():
        async with Harness(plain=1, api_key="client-k", admin_key="admin-k") as h:
            assert (await h.post("/v1/completions", BODY))[0] == 401
            ok = {"Authorization": "Bearer client-k"}
            assert (await h.post("/v1/completions", BODY, headers=ok))[0] == 200
            assert (await h.get("/admin/workers", headers=ok))[0] == 401  # the client key is not the admin key
            status, out = await h.get("/admin/workers", headers={"Authorization": "Bearer admin-k"})
            assert status == 200 and len(out["workers"]) == 1
            assert (await h.get("/v1/models"))[0] == 401
            assert (await h.get("/health"))[0] == 200
    run(main())


def test_admin_add_remove_drain():
    async def main():
        async with Harness(plain=2, policy="round_robin", worker_opts={"token_delay_s": 0.05}) as h:
            extra = h.plain.pop()
            h.router.pool.remove(extra.url)
            status, out, _ = await h.post("/admin/workers", {"url": extra.url, "role": "plain"})
            assert status == 201 and out["source"] == "admin"
            status, out, _ = await h.post("/admin/workers", {"url": "ftp://x"})
            assert status == 400
            status, out, _ = await h.post("/admin/workers", {"url": "http://127.0.0.1:1", "role": "decode"})
            assert status == 400 and "plain" in out["error"]["message"]
            # drain: the in-flight stream finishes, then the worker is removed; no new requests meanwhile
            first = asyncio.ensure_future(h.post("/v1/completions", {**BODY, "stream": True}))
            await eventually(lambda: sum(w.inflight for w in h.router.pool.workers.values()) == 1)
            busy = next(w for w in h.router.pool.workers.values() if w.inflight)
            status, out, _ = await h.post("/admin/workers/drain", {"url": busy.url})
            assert status == 200 and out["draining"]
            for _ in range(3):
                await h.post("/v1/completions", BODY)
            assert (await first)[0] == 200
            assert await eventually(lambda: busy.url not in h.router.pool.workers)
            async with h.session.delete(h.url + "/admin/workers", params={"url": extra.url}) as r:
                assert r.status in (200, 404)
        await extra.stop()
    run(main())


def test_models_health_metrics():
    async def main():
        async with Harness(plain=1) as h:
            status, out = await h.get("/v1/models")
            assert status == 200 and [m["id"] for m in out["data"]] == ["fake-model"]
            status, out = await h.get("/health")
            assert status == 200 and out["usable_workers"] == {"plain": 1}
            await h.post("/v1/completions", BODY)
            status, text = await h.get("/metrics")
            assert "pdsdk_router_requests_total" in text and "pdsdk_route_decisions_total" in text
            assert "process_cpu_seconds_total" in text or "python_info" in text
    run(main())


def test_stream_is_passed_through_chunk_by_chunk():
    async def main():
        async with Harness(plain=1, worker_opts={"chunks": 5, "token_delay_s": 0.1}) as h:
            loop = asyncio.get_running_loop()
            arrivals = []
            async with h.session.post(h.url + "/v1/completions", json={**BODY, "max_tokens": 5, "stream": True}) as r:
                async for chunk in r.content.iter_any():
                    arrivals.append((loop.time(), chunk))
            data = b"".join(c for _, c in arrivals)
            assert data.count(b"data: ") == 6 and data.endswith(b"data: [DONE]\n\n")
            # chunks arrive spread over the generation, not in one piece at the end
            assert arrivals[-1][0] - arrivals[0][0] > 0.3 and len(arrivals) >= 4
    run(main())


def test_official_openai_client_streaming_and_not():
    openai = pytest.importorskip("openai")
    ready, done = threading.Event(), threading.Event()
    box = {}

    async def serve():
        async with Harness("vllm", prefill=1, decode=1, api_key="k") as h:
            box["url"] = h.url
            ready.set()
            while not done.is_set():
                await asyncio.sleep(0.05)

    t = threading.Thread(target=lambda: asyncio.run(serve()))
    t.start()
    try:
        assert ready.wait(10)
        client = openai.OpenAI(base_url=box["url"] + "/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list()] == ["fake-model"]
        out = client.completions.create(model="fake-model", prompt="hi", max_tokens=2)
        assert out.choices[0].text == "tok0 tok1"
        chat = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3)
        assert chat.choices[0].message.content == "tok0 tok1 tok2"
        stream = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == "tok0 tok1 tok2 "
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=box["url"] + "/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        done.set()
        t.join(10)
