"""The router's HTTP layer against slow, greedy and malformed clients: read deadlines, body limits
judged while reading, connection caps, and a log that a client cannot flood."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from rawhttp import aexchange, request

from pdsdk.router.config import RouterConfig
from pdsdk.testing.router_harness import Harness


def run(coro):
    return asyncio.run(coro)


def closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Does the router close `s` within `seconds`? (and what it sent before)"""
    s.settimeout(seconds)
    got = b""
    try:
        while True:
            b = s.recv(65536)
            if not b:
                return True, got
            got += b
    except ConnectionResetError:
        return True, got
    except socket.timeout:
        return False, got


def test_slow_and_silent_connections_are_closed_within_the_read_timeout():
    """The reproduction: connections that sent nothing, half a head or half a body stayed open
    (190 s and counting); 20,000 of them took every file descriptor."""
    assert RouterConfig().read_timeout_s <= 15

    async def main():
        async with Harness(plain=1, read_timeout_s=0.5) as h:
            def probe(first: bytes) -> tuple[bool, bytes, float]:
                s = socket.create_connection(("127.0.0.1", h.port))
                t0 = time.monotonic()
                s.sendall(first)
                closed, got = closed_within(s, 3)
                s.close()
                return closed, got, time.monotonic() - t0

            for first in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"):
                closed, got, took = await asyncio.to_thread(probe, first)
                assert closed and took < 1.5, (first, took)
            half_body = request("/v1/completions", b'{"prompt": "hel', {"Content-Length": "100"})
            closed, got, took = await asyncio.to_thread(probe, half_body)
            assert closed and took < 1.5 and got.startswith(b"HTTP/1.1 408"), (took, got[:200])

            def half_second_request() -> tuple[bool, float]:  # after a first request answered in full
                s = socket.create_connection(("127.0.0.1", h.port))
                s.sendall(request("/v1/completions", b'{"model": "fake-model", "prompt": "hi"}', close=False))
                got = b""
                while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
                    got += s.recv(65536)
                t0 = time.monotonic()
                s.sendall(b"POST /v1/compl")
                closed, _ = closed_within(s, 3)
                s.close()
                return closed, time.monotonic() - t0

            closed, took = await asyncio.to_thread(half_second_request)
            assert closed and took < 1.5, took
    run(main())


def test_a_declared_body_over_the_limit_is_refused_at_once():
    """The reproduction: a declared 10 GB body with 1 MB sent was held open."""
    async def main():
        async with Harness(plain=1, max_body_bytes=1 << 20) as h:
            def send() -> tuple[bool, bytes, float]:
                s = socket.create_connection(("127.0.0.1", h.port))
                t0 = time.monotonic()
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 10000000000\r\n\r\n" + b"x" * (1 << 20))
                closed, got = closed_within(s, 5)
                s.close()
                return closed, got, time.monotonic() - t0

            closed, got, took = await asyncio.to_thread(send)
            assert got.startswith(b"HTTP/1.1 413") and b"10000000000" in got, got[:300]
            assert closed and took < 4, took
            # no declared length (chunked): refused as soon as the bytes read pass the limit
            chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                       b"Content-Type: application/json\r\nConnection: close\r\n\r\n" +
                       b"".join(b"%x\r\n%s\r\n" % (65536, b"y" * 65536) for _ in range(20)) + b"0\r\n\r\n")
            status, body = await aexchange(h.port, chunked)
            assert status == 413, body[:200]
            assert (await h.post("/v1/completions", {"model": "fake-model", "prompt": "hi"}))[0] == 200
    run(main())


def test_connections_are_capped_per_client_and_in_total():
    async def main():
        async with Harness(plain=1, max_client_connections=4, max_connections=6, read_timeout_s=5) as h:
            held = [socket.create_connection(("127.0.0.1", h.port)) for _ in range(4)]
            status, body = await aexchange(h.port, request("/health", method="GET"))
            assert status == 503 and b"per client" in body, body
            held.pop().close()
            await asyncio.sleep(0.1)
            status, _ = await aexchange(h.port, request("/health", method="GET"))
            assert status == 200
            assert h.router.gate.total == 3 and h.router.gate.per_client == {"127.0.0.1": 3}
            h.router.gate.max_client_connections = 100
            held += [socket.create_connection(("127.0.0.1", h.port)) for _ in range(3)]
            status, body = await aexchange(h.port, request("/health", method="GET"))
            assert status == 503 and b"limit of 6" in body, body
            for s in held:
                s.close()
            await asyncio.sleep(0.1)
            assert h.router.gate.total == 0
            assert (await aexchange(h.port, request("/health", method="GET")))[0] == 200
    run(main())


def test_malformed_requests_log_one_line_per_client_per_minute_without_traceback(caplog):
    caplog.set_level(logging.DEBUG)

    async def main():
        async with Harness(plain=1) as h:
            for _ in range(10):
                for raw in (b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nBad Header\r\n\r\n",
                            b"POST /v1/completions HTTP/1.1\r\nContent-Length: x\r\n\r\n",
                            request("/v1/completions", b'{"prompt": '), request("/v1/completions", b"[1]"),
                            request("/admin/workers", b'{"url": 5}')):
                    status, _ = await aexchange(h.port, raw)
                    assert 400 <= status < 500
    run(main())
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("client 127.0.0.1")]
    assert len(lines) == 1, lines
