"""Request bodies from clients: refused as soon as they are known to be too large, and given up
on when they stop coming; `Expect` headers."""

from __future__ import annotations

import asyncio

from aiohttp import HttpVersion11, web


async def expect_handler(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue` is answered; any other Expect gets a 417. (aiohttp's own handler puts
    the header in its 417 text, which fails on header bytes that are not UTF-8: a 500.)"""
    if request.headers.get("Expect", "").lower() != "100-continue":
        return web.json_response({"error": {"message": "the only Expect understood is 100-continue",
                                            "type": "invalid_request_error", "code": 417}}, status=417)
    if request.version == HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer itself has not started
    return None


class BodyError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def receive_body(request: web.Request, limit: int, idle_s: float) -> bytes:
    """The request's body. 413 as soon as it is known to pass `limit` (a declared length is
    judged before a byte is read), 408 when the client sends nothing for `idle_s`."""
    coding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if coding not in ("identity", ""):  # no decompression here: no bomb to defuse
        raise BodyError(415, f"Content-Encoding {coding[:40]!r}: request bodies are taken uncompressed only")
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyError(413, f"body of {declared} bytes is larger than the limit of {limit} bytes")
    stream = request.content
    if stream.is_eof():  # all of it is here already: the usual case, no timer
        data = await stream.read()
        if len(data) > limit:
            raise BodyError(413, f"body larger than the limit of {limit} bytes")
        return data
    parts, size = [], 0
    while True:
        try:
            chunk = await asyncio.wait_for(stream.readany(), idle_s)
        except asyncio.TimeoutError:
            raise BodyError(408, f"the request body stopped coming for {idle_s:g} s") from None
        if not chunk:
            return b"".join(parts)
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"body larger than the limit of {limit} bytes")
        parts.append(chunk)


async def answer_and_close(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """Send `resp` now and close the connection: the rest of the request will not be read."""
    await resp.prepare(request)
    await resp.write_eof()
    request.protocol.force_close()
    return resp
