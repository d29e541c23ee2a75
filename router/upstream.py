"""Talking to one worker: open a request, wait for its first bytes, relay the rest.

Failures are classified here: `Retryable` (connection refused/reset, timeout, 5xx, 429) may be
retried on another worker as long as nothing reached the client; a 4xx is the client's fault
and is passed through unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import aiohttp
import msgspec
from aiohttp import web

from pdsdk.router.workers import Worker

try:
    from asyncio import timeout as atimeout
except ImportError:  # Python 3.10: aiohttp's own dependency
    from async_timeout import timeout as atimeout

log = logging.getLogger(__name__)
RETRY_STATUSES = {408, 429, 500, 502, 503, 504}


class Retryable(Exception):
    def __init__(self, worker: Worker, reason: str):
        super().__init__(f"{worker.role} worker {worker.url}: {reason}")
        self.worker, self.reason = worker, reason
        self.suspects = [worker]  # workers the retry should avoid (the failed one, maybe its partner)


@dataclass
class Opened:
    worker: Worker
    resp: aiohttp.ClientResponse
    first: bytes  # first bytes of the body (b"" when the body is empty)


def _reason(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def open_stream(session: aiohttp.ClientSession, worker: Worker, path: str, body: dict,
                      headers: dict[str, str], first_timeout: float) -> Opened:
    """POST and wait (at most `first_timeout`) for status, headers and the first body bytes."""
    resp = None
    try:
        async with atimeout(first_timeout):
            resp = await session.post(worker.url + path, data=msgspec.json.encode(body),
                                      headers={"Content-Type": "application/json", **headers})
            first = await resp.content.readany()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        if resp is not None:
            resp.close()
        raise Retryable(worker, _reason(e)) from None
    except BaseException:
        if resp is not None:
            resp.close()  # cancelled (client went away): drop the connection, the engine aborts
        raise
    if resp.status in RETRY_STATUSES:
        text = first.decode(errors="replace")[:300]
        resp.close()
        raise Retryable(worker, f"HTTP {resp.status}: {text}")
    return Opened(worker, resp, first)


async def read_all(opened: Opened, timeout: float) -> bytes:
    try:
        async with atimeout(timeout):
            rest = await opened.resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        opened.resp.close()
        raise Retryable(opened.worker, _reason(e)) from None
    return opened.first + rest


async def post_json(session: aiohttp.ClientSession, worker: Worker, path: str, body: dict,
                    headers: dict[str, str], timeout: float) -> tuple[int, bytes]:
    """A whole request/response (vLLM prefill, SGLang prefill, tokenize)."""
    opened = await open_stream(session, worker, path, body, headers, timeout)
    return opened.resp.status, await read_all(opened, timeout)


def passthrough(status: int, data: bytes, content_type: str | None, request_id: str) -> web.Response:
    return web.Response(status=status, body=data, content_type=(content_type or "application/json"),
                        headers={"X-Request-Id": request_id})


def sse_error(message: str, code: int = 502) -> bytes:
    """An error event in the OpenAI streaming shape, sent when a stream breaks after its start."""
    return b"data: " + json.dumps({"error": {"message": message, "type": "upstream_error",
                                             "code": code}}).encode() + b"\n\n"


async def relay(request: web.Request, opened: Opened, gap_timeout: float, deadline: float,
                request_id: str) -> web.StreamResponse:
    """Stream the worker's body to the client chunk by chunk, as it arrives."""
    up = opened.resp
    out = web.StreamResponse(status=up.status, headers={
        "Content-Type": up.headers.get("Content-Type", "text/event-stream"),
        "Cache-Control": "no-cache", "X-Request-Id": request_id})
    await out.prepare(request)
    loop = asyncio.get_running_loop()
    try:
        if opened.first:
            await out.write(opened.first)
        while True:
            left = deadline - loop.time()
            if left <= 0:
                await out.write(sse_error("request deadline passed", 504))
                break
            try:
                async with atimeout(min(gap_timeout, left)):
                    chunk = await up.content.readany()
            except asyncio.TimeoutError:
                if left <= gap_timeout:  # our deadline, not the worker's silence
                    await out.write(sse_error("request deadline passed", 504))
                    break
                opened.worker.breaker.record(False)
                opened.worker.last_error = "silent mid-stream"
                await out.write(sse_error("worker failed mid-stream: silent too long"))
                break
            except (aiohttp.ClientError, OSError) as e:
                opened.worker.breaker.record(False)
                opened.worker.last_error = _reason(e)
                log.warning("stream from %s broke: %s", opened.worker.url, _reason(e))
                await out.write(sse_error(f"worker failed mid-stream: {_reason(e)}"))
                break
            if not chunk:
                break
            await out.write(chunk)
        await out.write_eof()
    finally:
        up.close()
    return out
