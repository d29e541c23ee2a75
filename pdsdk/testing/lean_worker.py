"""A lean HTTP/1.1 load client and a lean streaming worker, for `pdsdk bench router`.

Both are bare asyncio Protocols (uvloop when installed) with pre-encoded messages, so that on a
small machine the client and the worker take little of the CPU the router competes for, and the
bench measures the router rather than its test doubles. The worker speaks just enough OpenAI:
POST /v1/completions and /v1/chat/completions (streamed as SSE over chunked encoding, one write
per token, or whole), GET /health and GET /v1/models, and SGLang's GET /server_info and /model_info
(and their /get_ forms), which sglang-router reads when it adds a worker. For PD semantics and fault
injection the tests use fake_worker.py instead.

Run the worker alone: python -m pdsdk.testing.lean_worker --port P [--chunks N] [--token-delay S].
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from dataclasses import dataclass, field

import msgspec

MODEL = "fake-model"
_HEAD_END = b"\r\n\r\n"
_MAX_HEAD = 16 * 1024
_MAX_BODY = 1 << 20
_MODELS = msgspec.json.encode({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
# No model_path: sglang-router would try to load a tokenizer from it.
_SERVER_INFO = msgspec.json.encode({"served_model_name": MODEL, "dp_size": 1, "version": "lean"})
_MODEL_INFO = msgspec.json.encode({"is_generation": True, "model_type": "lean"})
_INFO = {"/v1/models": _MODELS, "/server_info": _SERVER_INFO, "/get_server_info": _SERVER_INFO,
         "/model_info": _MODEL_INFO, "/get_model_info": _MODEL_INFO}


def event_loop_runner():
    """uvloop.run when uvloop is installed, else asyncio.run."""
    try:
        import uvloop

        return uvloop.run
    except ImportError:
        return asyncio.run


def _nodelay(transport) -> None:
    import socket

    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# --- worker -------------------------------------------------------------------------------

def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _length(value: str) -> int:
    """A Content-Length value, or -1 when it is not a decimal number."""
    value = value.strip()
    return int(value) if value.isascii() and value.isdigit() else -1


class _WorkerProto(asyncio.Protocol):
    def __init__(self, server: LeanWorker):
        self.server, self.buf, self.transport = server, bytearray(), None

    def connection_made(self, transport):
        self.transport = transport
        _nodelay(transport)

    def _refuse(self, status: str, why: str) -> None:
        """Answers a request it cannot read and closes the connection (also an HTTP/2 preface:
        sglang-router probes every worker for gRPC)."""
        answer = msgspec.json.encode({"error": why})
        self.transport.write(LeanWorker._reply(status, "application/json", answer))
        self.transport.close()
        self.buf.clear()

    def data_received(self, data):
        self.buf += data
        while not self.transport.is_closing():
            end = self.buf.find(_HEAD_END)
            if end < 0:
                if len(self.buf) > _MAX_HEAD:
                    self._refuse("431 Request Header Fields Too Large", "request head too large")
                return
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            request_line = lines[0].split(" ")
            if len(request_line) != 3 or not request_line[2].startswith("HTTP/1."):
                return self._refuse("400 Bad Request", "not an HTTP/1.x request line")
            method, path, _ = request_line
            length = 0
            for ln in lines[1:]:
                k, _, v = ln.partition(":")
                if k.strip().lower() == "content-length":
                    length = _length(v)
            if not 0 <= length <= _MAX_BODY:
                return self._refuse("400 Bad Request", f"content-length must be 0..{_MAX_BODY}")
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4:end + 4 + length])
            del self.buf[:end + 4 + length]
            self.server.handle(self.transport, method, path, body)


class LeanWorker:
    """Streams `chunks` tokens per request, `token_delay_s` apart (0: all at once, one write each)."""

    def __init__(self, chunks: int = 8, token_delay_s: float = 0.0):
        self.chunks, self.token_delay_s = chunks, token_delay_s
        self.served = 0
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> LeanWorker:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _WorkerProto(self), host, port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    @staticmethod
    def _reply(status: str, ctype: str, payload: bytes) -> bytes:
        return (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(payload)}\r\n\r\n"
                .encode() + payload)

    def handle(self, transport, method: str, path: str, body: bytes) -> None:
        if method == "GET" and path == "/health":
            transport.write(self._reply("200 OK", "text/plain", b"OK"))
            return
        if method == "GET" and path in _INFO:
            transport.write(self._reply("200 OK", "application/json", _INFO[path]))
            return
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            transport.write(self._reply("404 Not Found", "application/json", b'{"error": "not found"}'))
            return
        try:
            req = msgspec.json.decode(body)
        except msgspec.DecodeError:
            req = None
        max_tokens = req.get("max_tokens") if isinstance(req, dict) else None
        if not isinstance(req, dict) or not isinstance(max_tokens, (int, type(None))):
            transport.write(self._reply("400 Bad Request", "application/json",
                                        b'{"error": "body must be a JSON object; max_tokens an integer"}'))
            return
        n = max(1, min(max_tokens or self.chunks, self.chunks))
        chat = "messages" in req
        self.served += 1
        if not req.get("stream"):
            text = " ".join(f"tok{i}" for i in range(n))
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            out = {"id": "cmpl-lean", "object": "chat.completion" if chat else "text_completion", "created": 0,
                   "model": MODEL, "choices": [choice]}
            transport.write(self._reply("200 OK", "application/json", msgspec.json.encode(out)))
            return
        events = []
        for i in range(n):
            choice = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
            choice.update({"delta": {"content": f"tok{i} "}} if chat else {"text": f"tok{i} "})
            chunk = {"id": "cmpl-lean", "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": 0, "model": MODEL, "choices": [choice]}
            events.append(_chunk(b"data: " + msgspec.json.encode(chunk) + b"\n\n"))
        events.append(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n")
        if not self.token_delay_s:
            for ev in events:  # one write per token, as an engine flushes each
                transport.write(ev)
            return
        asyncio.ensure_future(self._paced(transport, events))

    async def _paced(self, transport, events: list[bytes]) -> None:
        for ev in events[:-1]:
            await asyncio.sleep(self.token_delay_s)
            if transport.is_closing():
                return
            transport.write(ev)
        transport.write(events[-1])


# --- client -------------------------------------------------------------------------------

class _ClientProto(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self):
        self.transport = None
        self.buf = bytearray()
        self.done: asyncio.Future | None = None
        self.first: float = 0.0
        self.status = 0
        self._body_at = -1  # offset of the body once the head is in
        self._chunked = False
        self._length = 0
        self._scan = 0  # chunked: offset of the next chunk-size line
        self.lost = False

    def connection_made(self, transport):
        self.transport = transport
        _nodelay(transport)

    def connection_lost(self, exc):
        self.lost = True
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"connection lost: {exc}"))

    def send(self, request: bytes) -> asyncio.Future:
        self.buf.clear()
        self.first, self._body_at, self._scan = 0.0, -1, 0
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.done

    def data_received(self, data):
        now = time.perf_counter()
        self.buf += data
        buf = self.buf
        if self._body_at < 0:
            end = buf.find(_HEAD_END)
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            self.status = int(head[9:12])
            self._chunked = b"transfer-encoding: chunked" in head
            if not self._chunked:
                i = head.find(b"content-length:")
                self._length = int(head[i + 15:].split(b"\r\n", 1)[0]) if i >= 0 else 0
            self._body_at = self._scan = end + 4
        if not self.first and len(buf) > self._body_at:  # first body byte (a token), not the head
            self.first = now
        if self._chunked:
            while True:
                eol = buf.find(b"\r\n", self._scan)
                if eol < 0:
                    return
                size = int(bytes(buf[self._scan:eol]).split(b";")[0], 16)
                nxt = eol + 2 + size + 2
                if len(buf) < nxt:
                    return
                self._scan = nxt
                if size == 0:
                    break
        elif len(buf) < self._body_at + self._length:
            return
        if not self.done.done():
            self.done.set_result(self.status)


@dataclass
class LoadResult:
    latency: list[float] = field(default_factory=list)  # seconds, request written to last byte
    ttfb: list[float] = field(default_factory=list)  # seconds, request written to first body byte
    seconds: float = 0.0
    errors: int = 0


async def run_load(host: str, port: int, streams: int, total: int | None, body: dict,
                   path: str = "/v1/completions", stagger_s: float = 0.0, duration_s: float | None = None,
                   count_errors: bool = False) -> LoadResult:
    """`streams` keep-alive connections send `total` requests between them (or send requests for
    `duration_s` seconds), each waiting for its whole answer before sending the next (closed loop).
    Every connection is opened and has served one unrecorded request before the clock starts.
    With `stagger_s`, stream i starts i/streams of it later (and so does its warm-up), so that
    requests arrive spread out as in a steady state rather than all in the same instant. A non-200
    answer or a lost connection raises, or with `count_errors` counts in `errors` and the stream
    goes on (on a new connection if it lost its own)."""
    loop = asyncio.get_running_loop()
    payload = msgspec.json.encode(body)
    request = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    res = LoadResult()
    counter = iter(range(total)) if duration_s is None else itertools.count()
    deadline = float("inf")
    ready, go = [], asyncio.Event()

    async def one(proto: _ClientProto) -> tuple[float, float] | None:
        t0 = time.perf_counter()
        try:
            status = await proto.send(request)
            if status != 200:
                raise RuntimeError(f"HTTP {status} from {host}:{port}: {bytes(proto.buf[:300])!r}")
        except (RuntimeError, ConnectionError):
            res.errors += 1
            if not count_errors:
                raise
            return None
        return time.perf_counter() - t0, proto.first - t0

    async def stream(i: int) -> None:
        try:
            _, proto = await loop.create_connection(_ClientProto, host, port)
            if stagger_s:
                await asyncio.sleep(stagger_s * i / streams)
            await one(proto)  # warm-up
        finally:
            ready.append(1)
            if len(ready) == streams:  # all connected (or failed: gather below raises)
                go.set()
        await go.wait()
        if stagger_s:
            await asyncio.sleep(stagger_s * i / streams)
        for _ in counter:
            if time.perf_counter() >= deadline:
                break
            if proto.lost:  # the worker closed it (or the last request failed on it)
                _, proto = await loop.create_connection(_ClientProto, host, port)
            times = await one(proto)
            if times is not None:
                res.latency.append(times[0])
                res.ttfb.append(times[1])
        proto.transport.close()

    tasks = [asyncio.ensure_future(stream(i)) for i in range(streams)]
    try:
        await go.wait()
        start = time.perf_counter()
        if duration_s is not None:
            deadline = start + duration_s
        await asyncio.gather(*tasks)
        res.seconds = time.perf_counter() - start
    finally:
        for t in tasks:
            t.cancel()
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="lean streaming OpenAI-ish worker for `pdsdk bench router`")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (0: any)")
    ap.add_argument("--chunks", type=int, default=8, help="tokens per answer")
    ap.add_argument("--token-delay", type=float, default=0.0, help="seconds between streamed tokens")
    args = ap.parse_args(argv)

    async def run() -> None:
        w = await LeanWorker(args.chunks, args.token_delay).start(args.host, args.port)
        print(f"lean worker on http://{args.host}:{w.port}", flush=True)
        await asyncio.Event().wait()

    event_loop_runner()(run())


if __name__ == "__main__":
    main()
