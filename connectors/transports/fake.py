"""`fake`: the smallest complete transport; peers are transports of one process and bytes move by memcpy.

For tests of what sits above a transport, and the template for a new one: copy this file, set OPTIONS
and implement the `_`-prefixed methods. The base class checks and coalesces spans, keeps deadlines,
counts and calls the observation hooks. Option `drop`: transfers complete without moving a byte.
"""

from __future__ import annotations

import collections
import ctypes
import weakref
from typing import Any

from pdsdk import TransferStatus, Transport, TransportError

_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # agent -> open transport of this process


class FakeTransport(Transport):
    OPTIONS = {"drop": False}
    IN_PROCESS = True

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._inbox: collections.deque = collections.deque()  # (sender agent, notify message)
        _LIVE[self.agent] = self

    def _path(self) -> str:
        return "in-process memcpy" + (" (dropping bytes)" if self.options["drop"] else "")

    def _register(self, regions: list) -> None:
        if any(r.device != "cpu" for r in regions):
            raise TransportError("fake: host memory only")

    def _connect(self, descriptor: Any, peer: Any) -> Any:
        if descriptor.agent not in _LIVE:
            raise TransportError(f"fake: peer {descriptor.agent} is not a transport of this process")
        return descriptor.agent

    def _post(self, op: str, peer: Any, local: Any, remote: Any, notify: bytes | None) -> None:
        other = _LIVE.get(peer.backend)
        if other is None:  # failed by the base class, with this reason
            raise ConnectionError(f"peer {peer.agent} is closed")
        if not self.options["drop"]:
            for (li, lo, n), (ri, ro, _) in zip(local.tolist(), remote.tolist()):
                mine, theirs = self.regions[li].addr + lo, peer.regions[ri].addr + ro
                ctypes.memmove(*((mine, theirs) if op == "READ" else (theirs, mine)), n)
        if notify is not None:
            other._inbox.append((self.agent, notify))

    def _poll(self, backend: None) -> TransferStatus:
        return TransferStatus("done")  # _post copied already

    def _notifications(self) -> list[tuple[str, bytes]]:
        return [self._inbox.popleft() for _ in range(len(self._inbox))]

    def _close(self) -> None:
        _LIVE.pop(self.agent, None)
