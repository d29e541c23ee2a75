"""The side channel through which a decode worker fetches a prefill worker's transport descriptor.

The prefill engine serves one small ZeroMQ endpoint; its address travels in `kv_transfer_params`.
A decode worker asks once per (engine, TP rank) and caches the connection. msgpack both ways.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec
import zmq

log = logging.getLogger(__name__)


class SideChannelServer:
    """Answers {"tp_rank": r} with what `entries[r]` holds (set once the workers are up)."""

    def __init__(self, host: str, port: int = 0):
        self.entries: dict[int, dict[str, Any]] = {}
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.host = host
        self.port = self._sock.bind_to_random_port(f"tcp://{host}") if port == 0 else port
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pdsdk-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                ident, _, body = self._sock.recv_multipart(zmq.NOBLOCK)
                rank = msgspec.msgpack.decode(body)["tp_rank"]
            except (zmq.ZMQError, ValueError, KeyError, TypeError, msgspec.DecodeError):
                continue
            entry = self.entries.get(rank)
            reply = entry if entry is not None else {
                "error": f"no worker of TP rank {rank} has registered here (known: {sorted(self.entries)})"}
            self._sock.send_multipart([ident, b"", msgspec.msgpack.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)


def fetch(host: str, port: int, tp_rank: int, timeout_s: float) -> dict[str, Any]:
    """The entry a prefill engine serves for `tp_rank`; ConnectionError within `timeout_s`."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msgspec.msgpack.encode({"tp_rank": tp_rank}))
        reply = msgspec.msgpack.decode(sock.recv())
    except zmq.Again:
        raise ConnectionError(f"prefill side channel {host}:{port} did not answer within {timeout_s:g}s") from None
    finally:
        sock.close(0)
    if "error" in reply:
        raise ConnectionError(f"prefill side channel {host}:{port}: {reply['error']}")
    return reply
