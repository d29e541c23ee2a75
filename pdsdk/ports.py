"""Free TCP ports for the servers pdsdk starts (workers, routers, stores, test servers)."""

from __future__ import annotations

import socket
import threading

_given: set[int] = set()
_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, never the same one twice in this process: asked twice in a
    row, the kernel may offer the port it just released (two servers given one port, as a CI
    run once had mooncake_master's metrics and metadata servers)."""
    with _lock:
        while True:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _given:
                _given.add(port)
                return port
