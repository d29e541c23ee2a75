"""HTTP/1.1 by hand, for requests no client library would send (bytes that are not UTF-8 in a
header, a half-sent head, a half-close), and a router with fake workers served from a thread for
synchronous tests (hypothesis). Importable as `rawhttp`: pyproject puts tests/ on sys.path."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

from pdsdk.testing.router_harness import Harness


def request(path: str, body: bytes = b"", headers: dict | None = None, method: str = "POST",
            close: bool = True) -> bytes:
    """The bytes of one request; header names and values may be str (sent as latin-1) or bytes."""
    head = [f"{method} {path} HTTP/1.1\r\n".encode(), b"Host: 127.0.0.1\r\n"]
    given = {k.lower() if isinstance(k, str) else k.lower().decode("latin-1") for k in (headers or {})}
    if "content-type" not in given and body:
        head.append(b"Content-Type: application/json\r\n")
    if "content-length" not in given:
        head.append(b"Content-Length: %d\r\n" % len(body))
    if close:
        head.append(b"Connection: close\r\n")
    for k, v in (headers or {}).items():
        k = k if isinstance(k, bytes) else k.encode("latin-1")
        v = v if isinstance(v, bytes) else v.encode("latin-1")
        head.append(k + b": " + v + b"\r\n")
    return b"".join(head) + b"\r\n" + body


def parse(data: bytes) -> tuple[int, bytes]:
    """(status, body) of a whole answer read to the connection's end; 0 when there was none."""
    head, _, body = data.partition(b"\r\n\r\n")
    while head.startswith(b"HTTP/1.1 1"):  # interim answers (100 Continue)
        head, _, body = body.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return 0, data
    if b"transfer-encoding: chunked" in head.lower():
        body = dechunk(body)
    return int(parts[1]), body


def dechunk(data: bytes) -> bytes:
    out = []
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size.split(b";")[0] or b"0", 16)
        if n == 0:
            break
        out.append(rest[:n])
        data = rest[n + 2:]
    return b"".join(out)


def exchange(port: int, raw: bytes, timeout: float = 10.0, half_close: bool = False) -> tuple[int, bytes]:
    """Send `raw`, read until the router closes; (status, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            try:
                b = s.recv(65536)
            except ConnectionResetError:
                break
            if not b:
                break
            chunks.append(b)
    return parse(b"".join(chunks))


async def aexchange(port: int, raw: bytes, timeout: float = 10.0, half_close: bool = False) -> tuple[int, bytes]:
    return await asyncio.to_thread(exchange, port, raw, timeout, half_close)


class Records(logging.Handler):
    """Every log record while installed on the root logger."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def tracebacks(self) -> list[str]:
        return [f"{r.name}: {r.getMessage()}" for r in self.records if r.exc_info or r.levelno >= logging.ERROR]


class LiveRouter:
    """`with LiveRouter(plain=1) as r:` a Harness router and its fake workers on a thread's loop;
    r.port, r.call(fn) runs fn(harness) on that loop, r.log holds what was logged meanwhile."""

    def __init__(self, **harness_kw):
        self.kw = harness_kw
        self.log = Records()
        self._ready, self._done = threading.Event(), None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.h: Harness | None = None

    def __enter__(self) -> LiveRouter:
        logging.getLogger().addHandler(self.log)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self._thread.start()
        assert self._ready.wait(20), "router did not start"
        return self

    async def _serve(self):
        self.loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        async with Harness(**self.kw) as h:
            self.h = h
            self._ready.set()
            await self._done.wait()

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self._done.set)
        self._thread.join(20)
        logging.getLogger().removeHandler(self.log)

    @property
    def port(self) -> int:
        return self.h.port

    def call(self, fn):
        async def on_loop():
            return fn(self.h)
        return asyncio.run_coroutine_threadsafe(on_loop(), self.loop).result(10)

    def workers(self) -> dict:
        return self.call(lambda h: {u: (w.role, w.bootstrap_port, w.draining, w.kv_events)
                                    for u, w in h.router.pool.workers.items()})

    def breakers(self) -> dict:
        return self.call(lambda h: {u: (w.breaker.state, w.breaker.failures)
                                    for u, w in h.router.pool.workers.items()})

