"""What a client causes never counts against a worker: its own short deadline, a body every worker
chokes on, its going away. And a client that half-closes its connection still gets its answer."""

from __future__ import annotations

import asyncio
import json
import socket

from rawhttp import aexchange, request

from pdsdk.testing.router_harness import Harness, eventually

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


def run(coro):
    return asyncio.run(coro)


def breakers(h: Harness) -> list[tuple[str, int]]:
    return [(w.breaker.state, w.breaker.failures) for w in h.router.pool.workers.values()]


def test_client_deadlines_have_a_floor_and_never_open_a_breaker():
    """The reproduction: three requests with X-Request-Timeout: 0 timed out at once, counted as the
    worker's failures, opened its breaker, and every other client got 503."""
    async def main():
        async with Harness(plain=1, breaker_threshold=3, worker_opts={"token_delay_s": 0.4}) as h:
            for bad in ("nan", "-1", "abc", "inf", "1e999", ""):
                status, out, _ = await h.post("/v1/completions", BODY, headers={"X-Request-Timeout": bad})
                assert status == 400 and "X-Request-Timeout" in out["error"]["message"], (bad, out)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            outs = await asyncio.gather(*(h.post("/v1/completions", {**BODY, "stream": stream},
                                                 headers={"X-Request-Timeout": "0"})
                                          for stream in (False, True, False, True)))
            took = loop.time() - t0
            # 1.6 s of work against the 1 s floor: a 504, or a stream ended by a deadline event
            assert [o[0] for o in outs] == [504, 200, 504, 200] and "deadline" in outs[1][1], outs
            assert 0.9 < took < 1.5, took
            assert breakers(h) == [("closed", 0)]
            status, out, _ = await h.post("/v1/completions", BODY)
            assert status == 200, out
    run(main())


def test_a_body_every_worker_fails_on_is_not_the_workers_fault():
    """Two workers both answer 500 to one prompt (an input the engine chokes on): the client gets
    the error, and neither breaker moves; a worker that fails what another serves is blamed."""
    async def main():
        async with Harness(plain=2, policy="round_robin", breaker_threshold=2) as h:
            for w in h.plain:
                w.poison = "crash-me"
            for _ in range(3):
                status, out, _ = await h.post("/v1/completions", {**BODY, "prompt": "please crash-me"})
                assert status == 502 and "EngineCore failed" in out["error"]["message"], out
            assert breakers(h) == [("closed", 0), ("closed", 0)]
            assert (await h.post("/v1/completions", BODY))[0] == 200
            h.plain[0].poison = None
            h.plain[1].fail_status = 500  # now a worker that is broken for every request
            for _ in range(4):
                assert (await h.post("/v1/completions", BODY))[0] == 200
            assert h.router.pool.workers[h.plain[1].url].breaker.state == "open"
    run(main())


def test_half_closed_client_gets_its_answer():
    """The reproduction: a client that shuts down its sending side after its request (as
    `nc -N` or a one-shot script does) had its request cancelled and got nothing."""
    async def main():
        async with Harness(plain=1, worker_opts={"token_delay_s": 0.1}) as h:
            raw = request("/v1/completions", json.dumps(BODY).encode())
            status, body = await aexchange(h.port, raw, half_close=True)
            assert status == 200 and json.loads(body)["choices"][0]["text"] == "tok0 tok1 tok2 tok3", body
            status, body = await aexchange(h.port, request("/v1/completions", json.dumps({**BODY, "stream": True})
                                                           .encode()), half_close=True)
            assert status == 200 and body.endswith(b"data: [DONE]\n\n") and b"tok3" in body, body
            w = h.plain[0]
            assert not w.cancelled and len(w.completed) == 2
            assert breakers(h) == [("closed", 0)]
    run(main())


def test_a_client_that_closes_still_cancels_the_workers_request():
    async def main():
        async with Harness(plain=1, worker_opts={"token_delay_s": 0.5}) as h:
            for stream in (False, True):
                s = socket.create_connection(("127.0.0.1", h.port))
                s.sendall(request("/v1/completions", json.dumps({**BODY, "stream": stream}).encode()))
                await eventually(lambda: h.router.pool.workers[h.plain[0].url].inflight == 1)
                s.close()
                assert await eventually(lambda: len(h.plain[0].cancelled) == 1 + stream, timeout=1.5), stream
            assert await eventually(lambda: h.router.pool.workers[h.plain[0].url].inflight == 0)
            assert breakers(h) == [("closed", 0)] and not h.plain[0].completed
    run(main())
