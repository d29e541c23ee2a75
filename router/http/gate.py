"""Client connections to the router: caps, a deadline for each request head, half-close.

aiohttp's server waits for a request head without end and takes any number of connections. So
each client connection goes through a `Gate` (installed by `GateSite`):
- at most `max_connections` open, and `max_client_connections` from one address; a connection
  past either gets a 503 and is closed;
- a request head must be complete `read_timeout_s` after the connection opened, or after the
  first byte of a later request on it; else the connection is closed;
- a client that half-closes (shuts down its sending side) after a whole request still gets its
  answer. Before the answer starts, one `100 Continue` interim response (HTTP/1.1; every client
  skips it) tells that apart from a client that went away: a closed socket answers it with a
  reset, and the request is cancelled as on any disconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
from typing import Any

from aiohttp import HttpVersion11, web

from pdsdk.router.http.accept import Acceptor, listen
from pdsdk.router.http.client_log import ThrottledLog, error_message

log = logging.getLogger("pdsdk.router")
_PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"
_POLL_S = 0.1  # how often a half-closed client's socket is checked for the reset that says it left


def fit_to_fd_limit(max_connections: int) -> int:
    """Connections the process can hold: each may need a second descriptor to its worker, and a
    margin stays for the rest. The soft RLIMIT_NOFILE is raised toward the hard one when short."""
    need = 2 * max_connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        fit = max(16, (soft - 256) // 2)
        log.warning("--max-connections %d lowered to %d: the open-files limit is %d (ulimit -n)",
                    max_connections, fit, soft)
        return fit
    return max_connections


def _refusal(message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "unavailable", "code": 503}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


class Gate:
    """Admits client connections, wraps each in a `Conn`, and knows which request each handles
    (`middleware` marks a request's start and end)."""

    def __init__(self, max_connections: int, max_client_connections: int, read_timeout_s: float,
                 clients: ThrottledLog):
        self.max_connections, self.max_client_connections = max_connections, max_client_connections
        self.read_timeout_s, self.clients = read_timeout_s, clients
        self.total = 0
        self.per_client: dict[str, int] = {}
        self.conns: dict[object, Conn] = {}  # aiohttp's RequestHandler -> the Conn around it

    def admit(self, addr: str) -> str | None:
        """None when the connection may stay (it is then counted); else why not."""
        if self.total >= self.max_connections:
            return f"the router holds its limit of {self.max_connections} connections; retry later"
        mine = self.per_client.get(addr, 0)
        if mine >= self.max_client_connections:
            return f"{mine} connections from {addr} already: the limit per client; retry later"
        self.total += 1
        self.per_client[addr] = mine + 1
        return None

    def release(self, addr: str) -> None:
        self.total -= 1
        left = self.per_client[addr] - 1
        if left:
            self.per_client[addr] = left
        else:
            del self.per_client[addr]

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        conn = self.conns.get(request.protocol)
        if conn is None:
            return await handler(request)
        conn.started(request)
        try:
            resp = await handler(request)
        finally:
            conn.finished()
        if 400 <= resp.status < 500:
            self.clients.note(conn.addr, lambda: f"{resp.status} for {request.method} {request.path}: "
                                                 f"{error_message(resp)}")
        return resp


class Conn(asyncio.Protocol):
    """One client connection: aiohttp's RequestHandler (`inner`) behind the gate."""

    def __init__(self, gate: Gate, inner: asyncio.Protocol):
        self.gate, self.inner = gate, inner
        self.loop = asyncio.get_running_loop()  # made by the serving loop's protocol factory
        self.transport: asyncio.Transport | None = None
        self.addr = "-"
        self.request: web.BaseRequest | None = None  # the request being handled
        self.fresh = False  # bytes came toward a request that is not handled yet
        self.eof = False  # the client shut down its sending side
        self.timer: asyncio.TimerHandle | None = None  # the request head's deadline
        self.poller: asyncio.TimerHandle | None = None

    # --- the transport's calls ------------------------------------------------------------
    def connection_made(self, transport) -> None:
        peer = transport.get_extra_info("peername")
        self.addr = str(peer[0]) if isinstance(peer, tuple) and peer else "local"
        refused = self.gate.admit(self.addr)
        if refused:
            self.inner = None
            self.gate.clients.note(self.addr, f"connection refused: {refused}")
            transport.write(_refusal(refused))
            transport.close()
            return
        self.transport = transport
        self.gate.conns[self.inner] = self
        self.inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self.request is None:
            self.fresh = True
            if self.timer is None:
                self._arm()
        self.inner.data_received(data)

    def eof_received(self):
        if self.inner is None:
            return None
        self.eof = True
        if self.request is not None:
            return self._keep_half_open(self.request)
        return True if self.fresh else self.inner.eof_received()  # a head in the making: its deadline decides

    def connection_lost(self, exc) -> None:
        for h in (self.timer, self.poller):
            if h is not None:
                h.cancel()
        self.timer = self.poller = None
        if self.inner is None:
            return
        self.gate.release(self.addr)
        self.gate.conns.pop(self.inner, None)
        inner, self.inner, self.transport = self.inner, None, None
        inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # --- requests (from Gate.middleware) ---------------------------------------------------
    def started(self, request: web.BaseRequest) -> None:
        self.request, self.fresh = request, False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.eof and self.transport is not None and not self._keep_half_open(request):
            self.transport.close()  # the client is gone: its handler is cancelled

    def finished(self) -> None:
        self.request = None
        if self.poller is not None:
            self.poller.cancel()
            self.poller = None
        if self.eof and self.inner is not None:
            self.inner.close()  # nothing more can come: close once this answer is out

    # --- deadlines and half-close ----------------------------------------------------------
    def _arm(self) -> None:
        self.timer = self.loop.call_later(self.gate.read_timeout_s, self._head_late)

    def _head_late(self) -> None:
        self.timer = None
        if self.request is None and self.transport is not None:
            self.gate.clients.note(self.addr, f"no whole request head within {self.gate.read_timeout_s:g} s: "
                                              "connection closed")
            self.transport.close()

    def _keep_half_open(self, request: web.BaseRequest) -> bool:
        """The client shut down its sending side while `request` is handled: keep the connection
        to answer, unless its body can no longer come or the client is seen to be gone."""
        if not request.content.is_eof():
            return False
        if request.writer is not None and request.writer.output_size == 0:  # the answer has not started
            if request.version < HttpVersion11:
                return False  # no interim response for HTTP/1.0: take it as gone
            self.transport.write(_PROBE)
            self.poller = self.loop.call_later(_POLL_S, self._check_gone)
        return True

    def _check_gone(self) -> None:
        self.poller = None
        t = self.transport
        if t is None or t.is_closing() or self.request is None:
            return
        sock = t.get_extra_info("socket")
        try:
            gone = sock is None or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
        except OSError:
            gone = True
        if gone:
            t.abort()  # connection_lost: aiohttp cancels the handler, which drops the workers' requests
        else:
            self.poller = self.loop.call_later(_POLL_S, self._check_gone)


class GateSite(web.BaseSite):
    """A TCP site whose connections pass through `gate`: on host:port, or on a listening socket
    handed down by a launcher (`sock`)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, gate: Gate, backlog: int = 2048,
                 sock: Any = None, reuse_port: bool = False):
        super().__init__(runner, backlog=backlog)
        self.host, self.port, self.gate, self.sock = host, port, gate, sock
        self.reuse_port = reuse_port  # several processes listen on host:port, the kernel spreads connections

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        factory = self._runner.server
        sockets = [self.sock] if self.sock is not None else listen(self.host, self.port, self._backlog,
                                                                   self.reuse_port)
        self._server = Acceptor(sockets, lambda: Conn(self.gate, factory()))


