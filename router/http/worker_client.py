"""A lean HTTP/1.1 client for the router's hop to the workers (the request hot path).

aiohttp's client costs the router more CPU than anything else it does per request and per
streamed token (request object, connector, C parser feeding a StreamReader per chunk). This
client does only what the hop needs: POST with a body, keep-alive connections pooled per
origin, responses framed by chunked encoding, Content-Length or connection close, and body
bytes handed over as they arrive (a de-chunked stream). No compression is negotiated, no
redirects, no cookies, no proxies: workers are addressed directly.

Closing a response before its end closes the connection: that is how the engines learn that
the client went away and abort the request. A pooled connection that the worker closed while
idle is noticed (connection_lost) and dropped; a request that fails on a reused connection
before any answer byte is sent again once on a new connection (the worker never saw it).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl as _ssl
from urllib.parse import urlsplit

MAX_IDLE_PER_ORIGIN = 1024
_HIGH_WATER = 1 << 20  # buffered body bytes before reading from the worker pauses


def _nodelay(transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class H1Error(ConnectionError):
    """The worker's connection failed or its answer is not HTTP/1.1 we can read."""


class _Conn(asyncio.Protocol):
    def __init__(self, pool: H1Pool, origin: tuple):
        self.pool, self.origin = pool, origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.resp: Response | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        _nodelay(transport)

    def data_received(self, data: bytes) -> None:
        if self.resp is not None:
            self.resp._feed(data)
        else:  # bytes on an idle connection: nothing is owed, the connection is unusable
            self.abort()

    def eof_received(self):
        if self.resp is not None:
            self.resp._eof()
        return False  # close the transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.resp is not None:
            self.resp._lost(exc)
        self.pool._forget(self)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Response:
    """Status and headers once the head is in; body via readany() / read()."""

    def __init__(self, conn: _Conn):
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}  # lower-case names
        self.head = conn.pool._loop.create_future()  # set when status and headers are in
        self._buf = bytearray()  # unparsed bytes (head, chunk framing)
        self._mode = ""  # "chunked" | "length" | "close"
        self._left = 0  # length mode: body bytes still due; chunked: bytes of the current chunk
        self._chunk_state = 0  # 0: size line next, 1: in chunk data, 2: CRLF after data, 3: trailers
        self._body: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._done = False  # the whole answer was received
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._keep_alive = True
        self._paused = False
        self._held = False  # paused by the sink's owner (its client is slow)
        self._sink = None
        self.got_bytes = False

    # --- reading side ---------------------------------------------------------------------
    @property
    def content_type(self) -> str:
        v = self.headers.get("content-type")
        return v.split(";", 1)[0].strip().lower() if v else "application/octet-stream"

    @property
    def done(self) -> bool:
        """The whole answer was received (its last body bytes may still be queued or in delivery)."""
        return self._done

    @property
    def content(self) -> Response:  # aiohttp-like spelling: resp.content.readany()
        return self

    async def readany(self) -> bytes:
        """Body bytes received since the last call (waits for some); b"" at the end."""
        while not self._body:
            if self._done:
                self._finish()
                return b""
            await self._next_event()
        data = self._body.popleft() if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._queued = 0
        if self._paused:
            self._paused = False
            self._conn.transport.resume_reading()
        if self._done:
            self._finish()
        return data

    def set_sink(self, sink) -> None:
        """Hand body bytes to `sink(data)` as they arrive, in the protocol callback, instead of
        queueing them for readany(): no task wake-up per token. Queued bytes go first."""
        self._sink = sink
        if sink is not None and self._body:
            data = b"".join(self._body)
            self._body.clear()
            self._queued = 0
            if self._paused:
                self._paused = False
                self._conn.transport.resume_reading()
            sink(data)

    async def wait_done(self) -> None:
        """Wait until the whole answer has been received (with a sink: delivered)."""
        while not self._done:
            await self._next_event()

    async def _next_event(self) -> None:
        """Wait for the protocol callback's next news (bytes, the end, or an error, raised here)."""
        if self._exc is not None:
            raise self._exc
        self._waiter = self._conn.pool._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def hold(self, on: bool) -> None:
        """Stop (on) or restart reading from the worker, for a sink whose client is slow."""
        if self._conn.resp is not self:  # finished: the connection is no longer ours
            return
        if on != self._held and self._conn.transport is not None and not self._conn.closed:
            self._held = on
            if on:
                self._conn.transport.pause_reading()
            else:
                self._conn.transport.resume_reading()

    async def read(self) -> bytes:
        parts = []
        while True:
            b = await self.readany()
            if not b:
                return b"".join(parts)
            parts.append(b)

    def close(self) -> None:
        """Done with it: a finished answer frees the connection for reuse, an unfinished one
        closes it (the worker then aborts the request)."""
        if self._done and not self._body:
            self._finish()
        elif self._conn.resp is self:
            self._conn.resp = None
            self._conn.abort()

    release = close

    def _finish(self) -> None:
        conn = self._conn
        if conn.resp is self:
            conn.resp = None
            if self._held and not conn.closed:  # the answer ended while its client was slow
                self._held = False
                conn.transport.resume_reading()
            if self._keep_alive and not conn.closed:
                conn.pool._put(conn)
            else:
                conn.abort()

    # --- protocol side --------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _deliver(self, data) -> None:
        if data:
            if self._sink is not None:
                self._sink(data)
                return
            self._body.append(bytes(data))
            self._queued += len(data)
            if self._queued > _HIGH_WATER and not self._paused:
                self._paused = True
                self._conn.transport.pause_reading()

    def _feed(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            if not self.head.done():
                self._buf += data
                if not self._parse_head():
                    return
                data, self._buf = bytes(self._buf), bytearray()
            if self._mode == "chunked":
                self._feed_chunked(data)
            elif self._mode == "length":
                take = data[:self._left]
                self._left -= len(take)
                self._deliver(take)
                if self._left == 0:
                    self._done = True
                    if len(data) > len(take):  # bytes past the answer: the connection is not reusable
                        self._keep_alive = False
            else:
                self._deliver(data)
        except H1Error as e:
            self._fail(e)
            self._conn.abort()
            return
        if self._sink is None or self._done:
            self._wake()

    def _parse_head(self) -> bool:
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > 65536:
                    raise H1Error("response head larger than 64 KiB")
                return False
            lines = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
            del self._buf[:end + 4]
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                raise H1Error(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
            status = int(parts[1])
            if 100 <= status < 200:  # interim answer (100 Continue): the real one follows
                continue
            headers = {}
            for ln in lines[1:]:
                k, sep, v = ln.partition(":")
                if not sep:
                    raise H1Error(f"bad header line {ln[:80]!r}")
                k = k.strip().lower()
                v = v.strip()
                headers[k] = f"{headers[k]}, {v}" if k in headers else v
            self.status, self.headers = status, headers
            conn_hdr = headers.get("connection", "").lower()
            if parts[0] == "HTTP/1.0":
                self._keep_alive = "keep-alive" in conn_hdr
            elif "close" in conn_hdr:
                self._keep_alive = False
            te = headers.get("transfer-encoding", "").lower()
            if "chunked" in te:
                self._mode = "chunked"
            elif "content-length" in headers:
                try:
                    self._left = int(headers["content-length"])
                except ValueError:
                    raise H1Error(f"bad Content-Length {headers['content-length']!r}") from None
                self._mode = "length"
                if self._left == 0:
                    self._done = True
            elif status in (204, 304):
                self._mode, self._done = "length", True
            else:
                self._mode, self._keep_alive = "close", False
            self.head.set_result(None)
            return True

    def _feed_chunked(self, data: bytes) -> None:
        buf = self._buf
        if buf:
            buf += data
            data = bytes(buf)
            buf.clear()
        pos, n, out = 0, len(data), []
        while pos < n:
            st = self._chunk_state
            if st == 1:  # chunk data
                take = min(self._left, n - pos)
                out.append(data[pos:pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._chunk_state = 2
            elif st == 0 or st == 3:  # a size line, or a trailer line
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > 4096:
                        raise H1Error("chunk size line too long")
                    self._buf += data[pos:]
                    break
                line = data[pos:eol]
                pos = eol + 2
                if st == 3:
                    if not line:  # end of trailers: the answer is complete
                        self._done = True
                        if pos < n:
                            self._keep_alive = False
                        break
                    continue
                try:
                    size = int(line, 16)
                except ValueError:
                    try:  # chunk extensions (";name=value") or padding
                        size = int(line.split(b";", 1)[0].strip(), 16)
                    except ValueError:
                        raise H1Error(f"bad chunk size line {line[:40]!r}") from None
                if size < 0:
                    raise H1Error(f"bad chunk size line {line[:40]!r}")
                if size == 0:
                    self._chunk_state = 3
                elif pos + size + 2 <= n and data[pos + size:pos + size + 2] == b"\r\n":
                    out.append(data[pos:pos + size])  # the whole chunk is here: the usual case
                    pos += size + 2
                else:
                    self._left, self._chunk_state = size, 1
            else:  # st == 2: the CRLF after chunk data
                if n - pos < 2:
                    self._buf += data[pos:]
                    break
                if data[pos:pos + 2] != b"\r\n":
                    raise H1Error("chunk data not followed by CRLF")
                pos += 2
                self._chunk_state = 0
        if out:
            self._deliver(out[0] if len(out) == 1 else b"".join(out))

    def _eof(self) -> None:
        if self._mode == "close" and self.head.done():
            self._done = True
            self._keep_alive = False
            self._wake()
        elif not self._done:
            self._fail(H1Error("worker closed the connection mid-answer" if self.head.done()
                               else "worker closed the connection before answering"))

    def _lost(self, exc) -> None:
        if not self._done:
            if self._mode == "close" and self.head.done() and exc is None:
                self._done = True
                self._wake()
                return
            self._fail(H1Error(f"connection lost: {exc}" if exc else "connection closed"))

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None:
            self._exc = exc
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # retrieved: no "never retrieved" warning if nobody waits
        self._wake()


class H1Pool:
    """Keep-alive connections per origin (scheme, host, port); no limit on active ones."""

    def __init__(self, connect_timeout: float = 5.0, ssl_context: _ssl.SSLContext | None = None):
        self.connect_timeout = connect_timeout
        self._ssl = ssl_context
        self._idle: dict[tuple, list[_Conn]] = {}
        self._all: set[_Conn] = set()
        self._origins: dict[str, tuple] = {}
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = asyncio.get_event_loop()

    def _origin(self, base: str) -> tuple:
        o = self._origins.get(base)
        if o is None:
            u = urlsplit(base)
            tls = u.scheme == "https"
            port = u.port or (443 if tls else 80)
            host = u.hostname or ""
            hosthdr = f"[{host}]" if ":" in host else host
            if u.port and u.port != (443 if tls else 80):
                hosthdr += f":{u.port}"
            o = self._origins[base] = (tls, host, port, hosthdr)
        return o

    async def _connect(self, origin: tuple) -> _Conn:
        tls, host, port, _ = origin
        ctx = None
        if tls:
            if self._ssl is None:
                self._ssl = _ssl.create_default_context()
            ctx = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout) if hasattr(asyncio, "timeout") else \
                    _legacy_timeout(self.connect_timeout):
                _, conn = await self._loop.create_connection(lambda: _Conn(self, origin), host, port, ssl=ctx)
        except asyncio.TimeoutError:
            raise H1Error(f"connect to {host}:{port} timed out") from None
        self._all.add(conn)
        return conn

    def _put(self, conn: _Conn) -> None:
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) >= MAX_IDLE_PER_ORIGIN:
            conn.abort()
        else:
            idle.append(conn)

    def _forget(self, conn: _Conn) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    async def post(self, base: str, path: str, body: bytes, headers: dict[str, str]) -> Response:
        """Send the request; returns once the status and headers are in."""
        origin = self._origin(base)
        head = [f"POST {path} HTTP/1.1\r\nHost: {origin[3]}\r\nContent-Length: {len(body)}\r\n"]
        for k, v in headers.items():
            if "\r" in v or "\n" in v or "\r" in k or "\n" in k:
                raise ValueError(f"header {k!r} has a line break")
            head.append(f"{k}: {v}\r\n")
        head.append("\r\n")
        request = "".join(head).encode("latin-1") + body
        for attempt in (0, 1):
            idle = self._idle.get(origin)
            conn = None
            while idle:
                c = idle.pop()  # most recently used first
                if not c.closed and not c.transport.is_closing():
                    conn = c
                    break
            reused = conn is not None
            if conn is None:
                conn = await self._connect(origin)
            resp = conn.resp = Response(conn)
            conn.transport.write(request)
            try:
                await resp.head
            except H1Error:
                if reused and not resp.got_bytes and attempt == 0:
                    continue  # the worker had closed this idle connection: send once more on a new one
                raise
            except BaseException:
                resp.close()  # cancelled (timeout, client gone): drop the connection, the worker aborts
                raise
            return resp
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for c in list(self._all):
            c.abort()
        self._all.clear()
        self._idle.clear()


class _legacy_timeout:  # Python 3.10: asyncio.timeout is 3.11+
    def __init__(self, delay: float):
        self.delay = delay

    async def __aenter__(self):
        import async_timeout

        self._cm = async_timeout.timeout(self.delay)
        return await self._cm.__aenter__()

    async def __aexit__(self, *exc):
        return await self._cm.__aexit__(*exc)
