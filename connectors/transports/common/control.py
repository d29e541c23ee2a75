"""A small message channel between transports on two sides, for what one-sided libraries lack:
notifications (local), and requests and acknowledgements (two-sided libraries such as gloo).

ZeroMQ ROUTER/DEALER on TCP loopback (or the host given), msgpack bodies. A service thread
receives messages and hands each to `handler(sender, message)`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

log = logging.getLogger(__name__)


class ControlChannel:
    def __init__(self, agent: str, host: str, handler: Callable[[str, dict[str, Any]], None]):
        self.agent = agent
        self._handler = handler
        self._ctx = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self.port = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{self.port}"
        self._dealers: dict[str, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"pdsdk-control-{agent}", daemon=True)
        self._thread.start()

    def send(self, address: str, message: dict[str, Any]) -> None:
        """Queue a message for the channel at `address` (non-blocking; ZeroMQ reconnects on its own)."""
        body = msgspec.msgpack.encode(message)
        with self._send_lock:
            dealer = self._dealers.get(address)
            if dealer is None:
                dealer = self._ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.setsockopt(zmq.IDENTITY, self.agent.encode())
                dealer.connect(address)
                self._dealers[address] = dealer
            dealer.send(body)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                sender, body = self._router.recv_multipart(zmq.NOBLOCK)
                message = msgspec.msgpack.decode(body)
            except (zmq.ZMQError, ValueError, msgspec.DecodeError):
                continue
            try:
                self._handler(sender.decode(), message)
            except Exception:  # noqa: BLE001 - one bad message must not stop the channel
                log.exception("control handler failed on %r", message.get("op"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        with self._send_lock:
            for dealer in self._dealers.values():
                dealer.close(0)
            self._dealers.clear()
        self._router.close(0)
