"""The state the `nccl` transport keeps per pair and per transfer, and its small helpers."""

from __future__ import annotations

import itertools
import logging
import queue
import re
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger("pdsdk.connectors.transports.nccl.transport")


@dataclass(eq=False)
class Op:
    """One transfer this side initiated."""

    op: str
    pair: Pair
    notify: bytes | None
    tag: int = -1  # the first chunk's; chunk i moves under tag + i
    staging: Any = None  # pooled buffer behind the contiguous tensor, returned on release
    future: Future | None = None  # the waiter: done when our half (and any scatter) is done
    ack: tuple[bool, str | None] | None = None  # the acceptor's word: WRITE landed, or its half failed
    abandoned: bool = False  # released before the waiter ended: it must not scatter any more
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class Pair:
    """A 2-rank group with one peer. Initiator is rank 1, acceptor (the store's host) rank 0."""

    id: str
    agent: str  # the other side
    control: str  # its control channel
    rank: int
    pg: Any = None
    ping: socket.socket | None = None  # idle connection to the peer's store, for the watchdog
    serial: Serial | None = None  # acceptor: posts requests in arrival order
    tags: Any = field(default_factory=itertools.count)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ops: dict[int, Op] = field(default_factory=dict)  # initiator: transfers that may get an ack
    broken: str | None = None

    @property
    def peer_rank(self) -> int:
        return 1 - self.rank

    def take_tags(self, n: int) -> int:
        """n consecutive tags, one per chunk of a transfer; the first one names the transfer."""
        first = next(self.tags)
        self.tags = itertools.count(first + n)
        return first


def chunk_bounds(spans: np.ndarray, chunk_bytes: int) -> list[int]:
    """Row indices [0, ..., len(spans)] cutting spans into chunks of about chunk_bytes each.

    Scattered transfers move chunk by chunk so that packing one chunk overlaps moving the previous
    one. Rows are never cut here (split_spans does that first); a row longer than chunk_bytes is a
    chunk of its own. One chunk when chunk_bytes is 0 or the spans are one run."""
    if chunk_bytes <= 0 or len(spans) < 2:
        return [0, len(spans)]
    ends = np.cumsum(spans[:, 2])
    cuts = np.searchsorted(ends, np.arange(chunk_bytes, int(ends[-1]), chunk_bytes), side="right")
    return sorted({0, *cuts.tolist(), len(spans)})


class Serial:
    """A daemon thread running calls in submission order: NCCL pairs sends with receives by order."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable, *args: Any) -> None:
        self._queue.put((fn, args))

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                item[0](*item[1])
            except Exception:  # noqa: BLE001 - one bad request must not stop the pair
                log.exception("nccl: request failed")


def short_reason(e: BaseException) -> str:
    """One short line: gloo prefixes its source location and appends advice."""
    text = (str(e).strip().splitlines() or [""])[0]
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\] ", "", text).split(". This is typically")[0]
    return f"{type(e).__name__}: {text[:200]}"
