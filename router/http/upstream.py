"""Talking to one worker: open a request, wait for its first bytes, relay the rest.

Failures are classified here: `Retryable` (connection refused/reset, timeout, 5xx, 429) may be
retried on another worker as long as nothing reached the client; a 4xx is the client's fault
and is passed through unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from dataclasses import dataclass

import aiohttp
import msgspec
from aiohttp import web

from pdsdk.router import metrics
from pdsdk.router.http.worker_client import H1Pool, Response
from pdsdk.router.workers import Worker

try:
    from asyncio import timeout as atimeout
except ImportError:  # Python 3.10: aiohttp's own dependency
    from async_timeout import timeout as atimeout

log = logging.getLogger(__name__)
RETRY_STATUSES = {408, 429, 500, 502, 503, 504}


class Retryable(Exception):
    def __init__(self, worker: Worker, reason: str, status: int | None = None, timed_out: bool = False):
        super().__init__(f"{worker.role} worker {worker.url}: {reason}")
        self.worker, self.reason = worker, reason
        self.status, self.timed_out = status, timed_out  # the worker's error status; a timeout
        self.suspects = [worker]  # workers the retry should avoid (the failed one, maybe its partner)


@dataclass
class Opened:
    worker: Worker
    resp: Response
    first: bytes  # first bytes of the body (b"" when the body is empty)


def _reason(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def open_stream(client: H1Pool, worker: Worker, path: str, body: dict | bytes,
                      headers: dict[str, str], first_timeout: float) -> Opened:
    """POST and wait (at most `first_timeout`) for status, headers and the first body bytes.
    `body` is a dict to encode, or JSON bytes to send as they are."""
    resp = None
    headers["Content-Type"] = "application/json"
    try:
        async with atimeout(first_timeout):
            resp = await client.post(worker.url, path, body if isinstance(body, bytes) else msgspec.json.encode(body),
                                     headers)
            first = await resp.readany()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        if resp is not None:
            resp.close()
        raise Retryable(worker, _reason(e), timed_out=isinstance(e, asyncio.TimeoutError)) from None
    except BaseException:
        if resp is not None:
            resp.close()  # cancelled (client went away): drop the connection, the engine aborts
        raise
    if resp.status in RETRY_STATUSES:
        text = first.decode(errors="replace")[:300]
        resp.close()
        raise Retryable(worker, f"HTTP {resp.status}: {text}", status=resp.status)
    return Opened(worker, resp, first)


async def read_all(opened: Opened, timeout: float) -> bytes:
    try:
        async with atimeout(timeout):
            rest = await opened.resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        opened.resp.close()
        raise Retryable(opened.worker, _reason(e), timed_out=isinstance(e, asyncio.TimeoutError)) from None
    except BaseException:
        opened.resp.close()  # cancelled (client gone): drop the connection, the engine aborts
        raise
    return opened.first + rest


async def post_json(client: H1Pool, worker: Worker, path: str, body: dict,
                    headers: dict[str, str], timeout: float) -> tuple[int, bytes]:
    """A whole request/response (vLLM prefill, SGLang prefill, tokenize)."""
    opened = await open_stream(client, worker, path, body, headers, timeout)
    return opened.resp.status, await read_all(opened, timeout)


def passthrough(status: int, data: bytes, content_type: str | None, request_id: str) -> web.Response:
    return web.Response(status=status, body=data, content_type=(content_type or "application/json"),
                        headers={"X-Request-Id": request_id})


def sse_error(message: str, code: int, cut: str) -> bytes:
    """How a stream that broke after its start ends, counted by `cut` (why): an error event in
    the OpenAI streaming shape (OpenAI's client raises it as an APIError), then `data: [DONE]`
    (as vLLM ends its own failed streams) for clients that read until it."""
    metrics.STREAM_CUT.labels(cut).inc()
    return b"data: " + json.dumps({"error": {"message": message, "type": "upstream_error",
                                             "code": code}}).encode() + b"\n\ndata: [DONE]\n\n"


_HIGH, _LOW = 256 << 10, 64 << 10  # client write buffer: stop / restart reading from the worker


class _HeadWithBody(web.StreamResponse):
    """Its head leaves with the first body bytes, in one write (aiohttp 3.12+; older ones send it at once)."""

    _send_headers_immediately = False


async def relay(request: web.Request, opened: Opened, gap_timeout: float, deadline: float,
                request_id: str, loop: asyncio.AbstractEventLoop) -> web.StreamResponse:
    """Stream the worker's body to the client as it arrives.

    Direct mode (a chunked answer to an HTTP/1.1 client, the usual case): after the first bytes
    went out through aiohttp (which sends the head with them), each later piece is written to
    the client's transport from the worker connection's receive callback, framed as one chunk:
    no task wake-up and no aiohttp writer call per token. A slow client holds the worker
    connection (reading pauses) until its buffer drains. Otherwise each piece is read and
    written in a loop.

    The worker may stay silent at most `gap_timeout` (then it counts as failed) and the stream
    must end by `deadline`. One timer per stream watches both, re-arming itself from the last
    bytes received, instead of a timeout context (a timer created and cancelled) per token.

    Writes are system calls, the largest share of the router's CPU: an answer that came whole
    with its first bytes leaves in one write (head, body, end), and the last bytes of a stream
    leave with the end of the chunked body."""
    up = opened.resp
    out = _HeadWithBody(status=up.status, headers={
        "Content-Type": up.headers.get("content-type", "text/event-stream"),
        "Cache-Control": "no-cache", "X-Request-Id": request_id})
    if request.version >= aiohttp.HttpVersion11:
        out.enable_chunked_encoding()  # what aiohttp does anyway, said aloud: out.chunked tells
    await out.prepare(request)
    if up.done:
        up.close()
        try:
            await out.write_eof(opened.first)
        except ConnectionResetError:
            metrics.CLIENT_CANCELLED.inc()  # it left before its answer: there is no one left to tell
        return out
    task = asyncio.current_task(loop)
    transport = request.transport
    reading: float | None = None  # last bytes from the worker (or start of the read); None: not counting
    waiting = False  # awaiting the worker: the only place the watchdog may cancel us
    expired: str | None = None  # "deadline" or "silent": why the watchdog cancelled the wait
    client_gone = False
    tail = b""  # the answer's last bytes, held to leave with the end of the chunked body

    def watchdog() -> None:
        nonlocal timer, expired
        now = loop.time()
        if waiting:
            if now >= deadline:
                expired = "deadline"
            elif reading is not None and now - reading >= gap_timeout:
                expired = "silent"
            if expired:
                task.cancel()
                timer = None
                return
        due = min((reading if waiting and reading is not None else now) + gap_timeout, deadline)
        timer = loop.call_at(due if due > now else now + 0.05, watchdog)

    def sink(data: bytes) -> None:
        nonlocal reading, client_gone, tail
        reading = loop.time()
        if transport is None or transport.is_closing():
            client_gone = True
            up._fail(ConnectionResetError("client went away"))
            up.close()
            return
        if up.done:
            tail = data
            return
        transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        if transport.get_write_buffer_size() > _HIGH:
            up.hold(True)
            reading = None  # our client is slow, not the worker
            loop.call_later(0.005, unhold)

    def unhold() -> None:
        nonlocal reading
        if transport is None or transport.is_closing():
            sink(b"")  # notices the client is gone
        elif transport.get_write_buffer_size() > _LOW:
            loop.call_later(0.005, unhold)
        else:
            reading = loop.time()
            up.hold(False)

    def worker_failed(e: BaseException) -> bytes:
        opened.worker.breaker.record(False)
        opened.worker.last_error = _reason(e)
        log.warning("stream from %s broke: %s", opened.worker.url, _reason(e))
        return sse_error(f"worker failed mid-stream: {_reason(e)}", 502, "worker_failed")

    def on_expired() -> bytes:
        if sys.version_info >= (3, 11):
            task.uncancel()
        up.close()
        if expired == "deadline":
            return sse_error("request deadline passed", 504, "deadline")
        opened.worker.breaker.record(False)
        opened.worker.last_error = "silent mid-stream"
        return sse_error("worker failed mid-stream: silent too long", 502, "silent")

    timer = loop.call_at(min(loop.time() + gap_timeout, deadline), watchdog)
    try:
        if opened.first:
            await out.write(opened.first)
        if opened.first and out.chunked and not out.compression and transport is not None:
            reading, waiting = loop.time(), True
            try:
                up.set_sink(sink)
                await up.wait_done()
            except asyncio.CancelledError:
                waiting = False
                if expired is None:
                    raise  # the client went away
                await out.write(on_expired())
            except (aiohttp.ClientError, OSError) as e:
                waiting = False
                if client_gone:
                    raise ConnectionResetError("client went away") from None
                await out.write(worker_failed(e))
            waiting = False
        else:
            read = up.readany
            while True:
                now = loop.time()
                if now >= deadline:
                    await out.write(sse_error("request deadline passed", 504, "deadline"))
                    break
                reading, waiting = now, True
                try:
                    chunk = await read()
                except asyncio.CancelledError:
                    waiting = False
                    if expired is None:
                        raise  # the client went away
                    await out.write(on_expired())
                    break
                except (aiohttp.ClientError, OSError) as e:
                    waiting = False
                    await out.write(worker_failed(e))
                    break
                waiting = False
                if not chunk:
                    break
                await out.write(chunk)
        if timer is not None:
            timer.cancel()
            timer = None
        try:
            await out.write_eof(tail)
        except ConnectionResetError:
            pass  # the client left at the very end: there is no one left to tell
    finally:
        if timer is not None:
            timer.cancel()
        up.set_sink(None)
        up.close()
        # The closures above reach each other, this task and `up` through cells: unlinked here,
        # refcounting frees the request at once. Left as cycles, they piled up for the collector,
        # whose full passes stopped the event loop for 20-60 ms at 500 streams (the p99 tail).
        timer = sink = unhold = watchdog = None
    return out
