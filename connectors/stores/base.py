"""The L3 store contract (docs/stores.md).

Keys are content hashes of token pages chained from the prefix, so a page's key stands for the
whole prefix before it: `contains` and `get` answer with the length of the hit *prefix*. Pages are
byte buffers (bytes, memoryview, numpy arrays, CPU tensors via numpy()).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from pdsdk.plugins import notify

Buffer = Any  # anything exposing the buffer protocol

log = logging.getLogger("pdsdk.stores")
DemoteSink = Callable[[bytes, Buffer, "Hints"], None]


def byte_view(buf: Buffer) -> memoryview:
    """A flat byte view of a page or output buffer, without copying.

    Torch tensors do not export the buffer protocol; their numpy view (of the raw bytes, so
    bf16 works too) does."""
    try:
        view = memoryview(buf)
    except TypeError:
        view = memoryview(buf.view(__import__("torch").uint8).numpy())
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def copy_into(dst: memoryview, src) -> None:
    """dst[:len(src)] = src through numpy: a plain memcpy that releases the GIL, about 1.5x
    faster than memoryview slice assignment for large pages."""
    import numpy as np

    src_arr = np.frombuffer(src, np.uint8)
    np.copyto(np.frombuffer(dst, np.uint8)[: src_arr.size], src_arr)


class Hints(msgspec.Struct, frozen=True, kw_only=True):
    """L6 retention hints for pages being stored."""

    priority: int = 0  # higher survives longer under pressure
    ttl_s: float | None = None  # None: until evicted
    pin: bool = False  # survives pressure until ttl_s ends
    session: str | None = None  # agent/session the pages belong to
    keep: bool = True  # False: not worth keeping (e.g. reasoning tokens); stored last-in, evicted first


class StoreStats:
    """Counters every store keeps; thread-safe; reported by `Store.stats()` and the hooks."""

    FIELDS = ("hits", "misses", "puts", "bytes_in", "bytes_out", "evictions", "errors")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(self.FIELDS, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.counts[k] += v

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class Loan:
    """Stored pages lent in place (no copy) until `close()`: `pages` are uint8 views, `addresses` their
    host addresses (int64, for copy kernels; None when they cannot be given as one table)."""

    def __init__(self, pages: list[Any], addresses: Any, release: Callable[[], None], pinned: bool = False):
        self.pages, self.addresses, self.pinned = pages, addresses, pinned
        self._release: Callable[[], None] | None = release

    def __len__(self) -> int:
        return len(self.pages)

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> Loan:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Reservation:
    """Pages of a store's host pool handed out to be filled in place, then `commit`ted (or `cancel`led)."""

    def __init__(self, store: Store, pool: Any, pages: Any):
        self.store, self.pool, self.pages = store, pool, pages

    def __len__(self) -> int:
        return len(self.pages)

    @property
    def addresses(self) -> Any:
        return self.pool.addresses(self.pages)

    @property
    def pinned(self) -> bool:
        return self.pool.pinned

    def commit(self, keys: Sequence[bytes], hints: Hints | None = None) -> int:
        return self.store.commit(self, keys, hints)

    def cancel(self) -> None:
        self.store.cancel(self)


class Store(ABC):
    """A KV page store. Every method is thread-safe and never raises for a backend outage:
    an unreachable backend answers with misses and counts an error."""

    def __init__(self, name: str):
        self.name = name
        self._stats = StoreStats()
        self._demote: DemoteSink | None = None

    def set_demote(self, sink: DemoteSink | None) -> None:
        """Hand pages this store evicts for room to `sink(key, page, hints)` (the next tier)
        instead of dropping them. Stores that cannot read a victim back just drop it."""
        self._demote = sink

    @abstractmethod
    def put(self, keys: Sequence[bytes], pages: Sequence[Buffer], hints: Hints | None = None) -> int:
        """Store pages under keys; returns how many were stored (existing keys count as stored)."""

    @abstractmethod
    def get(self, keys: Sequence[bytes], out: Sequence[Buffer]) -> int:
        """Copy the longest stored prefix of `keys` into the writable buffers `out`; returns its length."""

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> int:
        """Length of the prefix of `keys` that is stored."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys; returns how many were present."""

    def prepare(self, page_bytes: int) -> None:
        """Allocate now what pages of `page_bytes` need (at an engine's start-up), not while serving:
        pinning host memory holds the GPU driver's lock, stalling the engine's kernel launches."""

    # Zero-copy access for the store data path, where pages sit in this process's host memory.
    def lend(self, keys: Sequence[bytes]) -> Loan | None:
        """The hit prefix's pages in place (count a hit/miss as `get` does); None: this store only copies."""
        return None

    def reserve(self, page_bytes: int, n: int, protect: Sequence[bytes] = ()) -> Reservation | None:
        """`n` host pages to fill in place and `commit` under keys; None: full, or this store only copies."""
        return None

    def commit(self, reservation: Reservation, keys: Sequence[bytes], hints: Hints | None = None) -> int:
        raise NotImplementedError(f"{self.name} hands out no reservations")

    def cancel(self, reservation: Reservation) -> None:
        raise NotImplementedError(f"{self.name} hands out no reservations")

    def stats(self) -> dict[str, Any]:
        return {"store": self.name, **self._stats.snapshot()}

    def close(self) -> None:
        """Release connections and memory; a second call does nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # For implementations: count into stats() and tell the observation hooks.
    def record_get(self, hits: int, asked: int, nbytes: int) -> None:
        """A get or lend of `asked` pages found the first `hits` of them (`nbytes` bytes)."""
        self._stats.add(hits=hits, misses=asked - hits, bytes_out=nbytes)
        if hits:
            notify("pdsdk_store_hit", store=self.name, pages=hits, nbytes=nbytes)
        if asked - hits:
            notify("pdsdk_store_miss", store=self.name, pages=asked - hits)

    def record_put(self, pages: int, nbytes: int) -> None:
        """A put stored `pages` new pages of `nbytes` bytes in all."""
        self._stats.add(puts=pages, bytes_in=nbytes)

    def record_error(self, n: int = 1) -> None:
        """The backend failed `n` times (answered as misses)."""
        self._stats.add(errors=n)

    def record_evictions(self, victims: Sequence[tuple]) -> None:
        """(key, nbytes, reason, ...) victims, one hook call per reason."""
        for reason in {v[2] for v in victims}:
            sizes = [v[1] for v in victims if v[2] == reason]
            self.record_evict(len(sizes), sum(sizes), reason)

    def record_evict(self, pages: int, nbytes: int, reason: str) -> None:
        """`pages` pages (`nbytes` bytes) went for `reason` ("capacity", "ttl", "delete", ...)."""
        if not pages:
            return
        self._stats.add(evictions=pages)
        notify("pdsdk_store_evict", store=self.name, pages=pages, nbytes=nbytes, reason=reason)
