"""The request hot path: the lean HTTP/1.1 client to the workers (framing, keep-alive, stale
connections, cancellation), the direct relay and its watchdog, raw body pass-through, and the
bench's lean worker and client."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from pdsdk.router.http import upstream, worker_client as h1
from pdsdk.router.http.worker_client import H1Error, H1Pool
from pdsdk.testing.lean_worker import LeanWorker, run_load
from pdsdk.testing.router_harness import Harness, eventually

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 6}


def run(coro):
    return asyncio.run(coro)


class Scripted:
    """A raw TCP server: answers each request head with the next scripted reply, written in
    pieces of `step` bytes (so every framing boundary lands mid-read somewhere)."""

    def __init__(self, replies: list[bytes], step: int = 1, close_after_each: bool = False):
        self.replies, self.step, self.close_after_each = list(replies), step, close_after_each
        self.connections = 0
        self.requests: list[bytes] = []
        self.eof_seen = asyncio.Event()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET "):  # a router's health checks and model lookups: not part of the script
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"data\":[]}")
                    continue
                n = int(next(ln for ln in head.decode().split("\r\n") if ln.lower().startswith("content-length"))
                        .split(":")[1])
                self.requests.append(head + await reader.readexactly(n))
                reply = self.replies.pop(0)
                if isinstance(reply, tuple):  # pieces, a pause before each (as tokens are generated)
                    for piece in reply:
                        await asyncio.sleep(0.05)
                        writer.write(piece)
                    continue
                for i in range(0, len(reply), self.step):
                    writer.write(reply[i:i + self.step])
                    await writer.drain()
                    await asyncio.sleep(0)
                if self.close_after_each:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eof_seen.set()
        finally:
            writer.close()

    async def stop(self):
        self.server.close()


def chunked(*parts: bytes, trailer: bytes = b"") -> bytes:
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts)
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + body
            + b"0\r\n" + trailer + b"\r\n")


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_h1_chunked_framing_at_every_boundary(step):
    async def main():
        parts = [b"data: one\n\n", b"x" * 300, b"data: [DONE]\n\n"]
        srv = Scripted([b"HTTP/1.1 100 Continue\r\n\r\n" + chunked(*parts, trailer=b"X-T: 1\r\n"),
                        chunked(b"again")], step=step)
        url = await srv.start()
        pool = H1Pool()
        r = await pool.post(url, "/v1/completions", b'{"a": 1}', {"X-Request-Id": "r1"})
        assert r.status == 200 and r.content_type == "text/event-stream"
        assert await r.read() == b"".join(parts)
        r2 = await pool.post(url, "/v1/completions", b"{}", {})  # the same keep-alive connection
        assert await r2.read() == b"again" and srv.connections == 1
        assert b"X-Request-Id: r1" in srv.requests[0] and srv.requests[0].endswith(b'{"a": 1}')
        await pool.close()
        await srv.stop()
    run(main())


def test_h1_content_length_close_delimited_and_errors():
    async def main():
        srv = Scripted([(b"HTTP/1.1 400 Bad\r\nContent-Type: application/json; charset=utf-8\r\n"
                         b"Content-Length: 11\r\n\r\n{\"e\": \"x\"}\n")], step=5)
        url = await srv.start()
        pool = H1Pool()
        r = await pool.post(url, "/x", b"{}", {})
        assert r.status == 400 and r.content_type == "application/json" and await r.read() == b'{"e": "x"}\n'
        ends = Scripted([b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end"], step=5,
                        close_after_each=True)
        r = await pool.post(await ends.start(), "/x", b"{}", {})
        assert await r.read() == b"until the end"
        with pytest.raises(ValueError):
            await pool.post(url, "/x", b"{}", {"X-Evil": "a\r\nInjected: 1"})
        await pool.close()
        await srv.stop()
        bad = Scripted([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\nab\r\n"])
        url = await bad.start()
        pool = H1Pool()
        for _ in range(2):
            r = await pool.post(url, "/x", b"{}", {})
            with pytest.raises(H1Error):
                await r.read()
        truncated = Scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"], close_after_each=True)
        url = await truncated.start()
        r = await pool.post(url, "/x", b"{}", {})
        with pytest.raises(H1Error):
            await r.read()
        await pool.close()
    run(main())


def test_h1_idle_connection_closed_by_worker_is_replaced():
    async def main():
        # The server closes after each answer without saying so (like an idle keep-alive timeout).
        srv = Scripted([chunked(b"1"), chunked(b"2"), chunked(b"3")], close_after_each=True)
        url = await srv.start()
        pool = H1Pool()
        for want in (b"1", b"2", b"3"):
            r = await pool.post(url, "/x", b"{}", {})
            assert await r.read() == want
            await asyncio.sleep(0.05)
        assert srv.connections == 3
        await pool.close()
    run(main())


def test_h1_closing_an_unfinished_answer_closes_the_connection():
    async def main():
        srv = Scripted([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"], step=1000)
        url = await srv.start()
        pool = H1Pool()
        r = await pool.post(url, "/x", b"{}", {})
        assert await r.readany() == b"hello"
        r.close()  # the worker must see the connection go: that is how engines abort
        await asyncio.wait_for(srv.eof_seen.wait(), 5)
        assert not any(pool._idle.values())
        await pool.close()
    run(main())


def test_plain_body_goes_to_the_worker_byte_for_byte_unless_the_router_must_change_it():
    async def main():
        async with Harness(plain=1) as h:
            raw = b'{"model":"fake-model",  "prompt":"hi \\u00e9", "max_tokens":2, "x": 1.50}'
            status, _, _ = await h.post("/v1/completions", raw=raw, headers={"Content-Type": "application/json"})
            assert status == 200 and h.plain[0].requests[-1]["raw"] == raw
            status, _, _ = await h.post("/v1/completions", {**BODY, "pdsdk": {"priority": 2}})
            sent = h.plain[0].requests[-1]
            assert status == 200 and "pdsdk" not in sent["body"]
            assert sent["body"]["kv_transfer_params"] == {"pdsdk_hints": {"priority": 2}}
    run(main())


def test_stream_relayed_directly_and_for_http10_clients():
    async def main():
        calls = []
        orig = h1.Response.set_sink

        def spy(self, sink):
            if sink is not None:  # None: the relay unlinking its sink at the end
                calls.append(True)
            return orig(self, sink)

        h1.Response.set_sink = spy
        try:
            async with Harness(plain=1, worker_opts={"chunks": 6, "token_delay_s": 0.01}) as h:
                status, out, _ = await h.post("/v1/completions", {**BODY, "stream": True})
                assert status == 200 and out.count("data: ") == 7 and out.endswith("data: [DONE]\n\n")
                assert calls == [True]
                reader, writer = await asyncio.open_connection("127.0.0.1", h.port)  # HTTP/1.0: no chunking
                body = json.dumps({**BODY, "stream": True}).encode()
                writer.write(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                text = (await asyncio.wait_for(reader.read(), 10)).decode()
                writer.close()
                assert text.startswith("HTTP/1.0 200") and "chunked" not in text.lower()
                assert text.count("data: ") == 7 and calls == [True]  # no sink: the read/write loop
        finally:
            h1.Response.set_sink = orig
    run(main())


def test_writes_to_the_client_are_few(monkeypatch):
    """System calls are the largest share of the router's CPU: an answer that came whole leaves in
    one write (head, body, end of the chunked body), and a stream's last bytes leave with its end."""
    from asyncio import selector_events

    from pdsdk.router.config import RouterConfig
    from pdsdk.router.server import start

    events = [b"data: {\"n\": %d}\n\n" % i for i in range(3)]
    piece = [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
    whole = chunked(*events)
    head = whole[:whole.index(b"\r\n\r\n") + 4]
    paced = (head + piece[0], piece[1], piece[2] + b"0\r\n\r\n")  # the worker's last event comes with its end
    writes: list[int] = []  # the local port of each write's transport
    T = selector_events._SelectorSocketTransport

    def counted(orig):
        def write(self, data):
            if not getattr(self, "_counted", False):  # writelines may call write
                writes.append(self.get_extra_info("sockname")[1])
            self._counted = True
            try:
                return orig(self, data)
            finally:
                self._counted = False
        return write

    monkeypatch.setattr(T, "write", counted(T.write))
    monkeypatch.setattr(T, "writelines", counted(T.writelines))

    async def main():
        worker = Scripted([whole, paced], step=1 << 20)
        url = await worker.start()
        _, runner, port = await start(RouterConfig(port=0, workers=[url], health_interval_s=60))
        try:
            for n in (1, 3):  # whole: one write; paced: head with the first event, the second, the last with the end
                writes.clear()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                body = json.dumps({**BODY, "stream": True}).encode()
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                got = await asyncio.wait_for(reader.read(), 10)
                writer.close()
                assert got.startswith(b"HTTP/1.1 200") and got.endswith(events[2] + b"\r\n0\r\n\r\n"), got
                assert writes.count(port) == n, writes
        finally:
            await runner.cleanup()
            await worker.stop()

    run(main())


def test_worker_silent_mid_stream_ends_the_stream_and_counts_against_it():
    async def main():
        async with Harness(plain=1, first_token_timeout_s=0.3, worker_opts={"chunks": 8}) as h:
            h.plain[0].stall_after = 2
            status, out, _ = await h.post("/v1/completions", {**BODY, "max_tokens": 8, "stream": True})
            assert status == 200 and "tok1" in out and "tok2" not in out and "silent too long" in out
            w = h.router.pool.workers[h.plain[0].url]
            assert w.last_error == "silent mid-stream" and w.breaker.failures == 1
            assert await eventually(lambda: h.plain[0].cancelled)  # the router hung up on it
    run(main())


def test_slow_client_holds_the_worker_then_gets_everything():
    async def main():
        old = upstream._HIGH, upstream._LOW
        upstream._HIGH, upstream._LOW = 1, 0  # every piece counts as a full client buffer
        try:
            async with Harness(plain=1, worker_opts={"chunks": 20}) as h:
                for _ in range(3):  # the pooled connection is reused: it must not stay paused
                    status, out, _ = await h.post("/v1/completions", {**BODY, "max_tokens": 20, "stream": True},
                                                  timeout=5)
                    assert status == 200 and out.count("data: ") == 21 and out.endswith("data: [DONE]\n\n")
                assert not any(c.resp for c in h.router.client._all)
        finally:
            upstream._HIGH, upstream._LOW = old
    run(main())


def test_lean_worker_and_client_through_the_router():
    async def main():
        from pdsdk.router.config import RouterConfig
        from pdsdk.router.server import start

        w = await LeanWorker(chunks=4).start()
        _, runner, port = await start(RouterConfig(port=0, workers=[f"http://127.0.0.1:{w.port}"]))
        try:
            body = {"model": "fake-model", "prompt": "p", "max_tokens": 4, "stream": True}
            direct = await run_load("127.0.0.1", w.port, 5, 20, body)
            routed = await run_load("127.0.0.1", port, 5, 20, body)
            assert len(direct.latency) == len(routed.latency) == 20 and not direct.errors and not routed.errors
            chat = {"model": "fake-model", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
            async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                                            json=chat) as r:
                out = await r.json()
            assert r.status == 200 and out["choices"][0]["message"]["content"] == "tok0 tok1"
        finally:
            await runner.cleanup()
            await w.stop()
        assert w.served >= 41
    run(main())


def test_bench_index_speed_small():
    import argparse

    from pdsdk.bench.router import index_speed

    r = index_speed(argparse.Namespace(index_blocks=4096, block_size=16))
    assert r["blocks"] >= 4096 and r["events_per_s"] > 0 and r["events_per_cpu_s"] > 0 and r["lookups_per_s"] > 0
    json.dumps(r)


def test_a_relayed_stream_leaves_no_cycles_for_the_collector():
    """Each request's relay state is freed by refcounting when it ends: cycles left behind made the
    collector's full passes stop the router's event loop for 20-60 ms at 500 streams."""
    import gc

    async def main():
        async with Harness(plain=1, worker_opts={"chunks": 4, "token_delay_s": 0.002}) as h:
            await h.post("/v1/completions", {**BODY, "stream": True})  # warm: pools, lazy imports
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for _ in range(5):
                    status, out, _ = await h.post("/v1/completions", {**BODY, "stream": True})
                    assert status == 200 and out.endswith("data: [DONE]\n\n")
                gc.collect()
                left = [o for o in gc.garbage if "relay.<locals>" in getattr(o, "__qualname__", "")]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
            assert left == []

    run(main())
