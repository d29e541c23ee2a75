"""Accepting client connections: every pending one each time the listening socket wakes up.

uvloop (the router's loop when installed) accepts one connection per turn of the loop. On a busy
router a turn takes tens of milliseconds, so 500 connections opened at once took ~10 s to be
accepted, and their first requests waited that long. `listen` binds like `loop.create_server`;
`Acceptor` drains each socket's queue at every wake-up and hands the sockets to the loop.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

log = logging.getLogger("pdsdk.router")
BATCH = 1024  # connections taken per wake-up at most: a flood of them cannot hold the loop for long
PAUSE_S = 1.0  # out of descriptors: stop accepting this long (asyncio does the same)
_SHORT_OF = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def listen(host: str, port: int, backlog: int, reuse_port: bool = False) -> list[socket.socket]:
    """Listening sockets on every address of `host` (all of them for '' or None), as create_server binds."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    out: list[socket.socket] = []
    try:
        for family, _, _, _, addr in dict.fromkeys((i[0], 0, 0, "", i[4]) for i in infos):
            out.append(socket.create_server(addr, family=family, backlog=backlog, reuse_port=reuse_port))
    except OSError:
        for s in out:
            s.close()
        raise
    return out


class Acceptor:
    """An asyncio.Server stand-in for aiohttp's sites: `sockets`, `close()`, `wait_closed()`."""

    def __init__(self, sockets: list[socket.socket], factory: Callable[[], asyncio.Protocol]):
        self.sockets, self.factory = sockets, factory
        self.loop = asyncio.get_running_loop()
        self.tasks: set[asyncio.Task] = set()
        for s in sockets:
            s.setblocking(False)
            self.loop.add_reader(s.fileno(), self._ready, s)

    def _ready(self, sock: socket.socket) -> None:
        for _ in range(BATCH):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:
                if e.errno in _SHORT_OF:
                    log.error("cannot accept connections for %g s: %s (raise ulimit -n or lower --max-connections)",
                              PAUSE_S, e)
                    self.loop.remove_reader(sock.fileno())
                    self.loop.call_later(PAUSE_S, self._resume, sock)
                else:
                    log.warning("accept failed: %s", e)
                return
            conn.setblocking(False)
            task = self.loop.create_task(self._connect(conn))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.factory, conn)
        except OSError:  # the client left before its transport was made
            conn.close()

    def _resume(self, sock: socket.socket) -> None:
        if sock.fileno() >= 0:
            self.loop.add_reader(sock.fileno(), self._ready, sock)

    def close(self) -> None:
        for s in self.sockets:
            if s.fileno() >= 0:
                self.loop.remove_reader(s.fileno())
                s.close()

    async def wait_closed(self) -> None:
        return None
