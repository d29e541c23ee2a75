"""Free TCP ports for the servers pdsdk starts (workers, routers, stores, test servers)."""

from __future__ import annotations

import random
import socket
import threading

from pdsdk.errors import ConfigError

_given: set[int] = set()
_lock = threading.Lock()
_rng = random.SystemRandom()  # two processes picking at once start from different ports
LINUX_EPHEMERAL = (32768, 60999)
LOWEST = 10000  # clear of the well-known ports services listen on
# SGLang derives its gRPC port as --port + 10000 and refuses to start past 65535
HIGHEST = 65535 - 10000


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for bind(0) and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return LINUX_EPHEMERAL


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, outside the kernel's ephemeral range, never the same one
    twice in this process.

    Outside the ephemeral range because a port is picked long before its server binds it (a router
    starts after its engines load, minutes later), and meanwhile any process's bind(0) or outgoing
    connection could be given an ephemeral port (an engine's own ZMQ or gloo sockets, say). Never
    twice, because asked twice in a row the kernel may offer the port it just released (two servers
    of one process would get the same port).
    At most HIGHEST, for the ports engines derive from theirs.
    """
    lo, hi = ephemeral_range()
    with _lock:
        for _ in range(1000):  # on Linux's defaults about half the candidates are ephemeral
            port = _rng.randint(LOWEST, HIGHEST)
            if not lo <= port <= hi and port not in _given and bindable(host, port):
                _given.add(port)
                return port
    raise OSError(f"no free TCP port on {host} in {LOWEST}-{HIGHEST} outside the ephemeral range {lo}-{hi} "
                  "(sysctl net.ipv4.ip_local_port_range)")


def bindable(host: str, port: int, reuse: bool = False) -> bool:
    """Whether a server could bind host:port now. reuse: as a server with SO_REUSEADDR (aiohttp,
    uvicorn), which a closed connection in TIME_WAIT does not stop; without it, that counts too."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            if reuse:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        return True
    except OSError:
        return False


def require_free(host: str, port: int, field: str) -> None:
    """Fail now, naming the flag, when a server pdsdk is about to start could not bind its port."""
    if port and not bindable(host, port, reuse=True):
        raise ConfigError(field, f"port {port} on {host} is in use; pick another {field} or stop what "
                                 f"listens there (e.g. `ss -ltnp 'sport = :{port}'`)")
