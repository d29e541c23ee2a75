"""`memory`: pages in this process's RAM, bounded in bytes, evicted by hint-aware LRU.

Pages live in a host page pool (common/pool.py), pinned where a GPU is present
(`pinned: auto`), so the store data path copies a GPU's KV blocks straight into and out of them:
`reserve` + `commit` store pages the caller fills in place, `lend` hands out the stored pages
themselves. `put` and `get` copy, for every other caller. Copies happen outside the lock; a page
evicted while a reader still copies from it is freed only once no reader is left.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from pdsdk.connectors.stores.base import Buffer, Hints, Loan, Reservation, Store, byte_view, copy_into, log
from pdsdk.connectors.stores.common.eviction import EvictionOrder
from pdsdk.connectors.stores.common.pool import PagePool, can_pin


class MemoryStore(Store):
    def __init__(self, name: str = "memory", capacity_bytes: int = 1 << 30, pinned: bool | str = "auto"):
        super().__init__(name)
        self.capacity_bytes = int(capacity_bytes)
        if pinned not in (True, False, "auto"):
            raise ValueError(f"memory store option 'pinned' must be true, false or \"auto\", not {pinned!r}")
        self.pinned = can_pin() if pinned == "auto" else bool(pinned)
        self._pools: dict[int, PagePool] = {}  # by page size (one in practice: the model's block)
        self._pages: dict[bytes, tuple[PagePool, int]] = {}
        self._eviction = EvictionOrder()
        self._lock = threading.Lock()
        self._readers = 0  # gets and loans reading outside the lock
        self._deferred: list[tuple[PagePool, int]] = []  # pages dropped while readers were busy

    # --- zero-copy API (the store data path) -------------------------------------------------------

    def prepare(self, page_bytes: int) -> None:
        with self._lock:
            pool = self._pool(page_bytes)
        pool.fill()

    def reserve(self, page_bytes: int, n: int, protect: Sequence[bytes] = ()) -> Reservation | None:
        """`n` writable pages of `page_bytes` to fill, then `commit`; None when they do not fit."""
        with self._lock:
            pool = self._pool(page_bytes)
        pages = pool.alloc(n)  # may allocate memory: not under the store's lock, which loads take
        victims, held, demoted = [], [], []
        if pages is None:
            with self._lock:
                need = (n - pool.free_pages) * page_bytes
                victims = self._eviction.victims(need, set(protect))
                held = [(v, self._pages.pop(v.key)) for v in victims if v.key in self._pages]
                demoted = [(v.key, p, v.hints) for v, p in held if v.hints is not None]
        self.record_evictions(victims)
        if self._demote is not None:
            for key, (p, page), hints in demoted:
                self._demote(key, p.view(page), hints)
        if held:
            with self._lock:
                for _, entry in held:
                    self._release(entry)
                pages = pool.alloc(n)
        if pages is None:
            return None
        return Reservation(self, pool, pages)

    def commit(self, reservation: Reservation, keys: Sequence[bytes], hints: Hints | None = None) -> int:
        """Store the first len(keys) reserved pages under `keys`; the rest go back to the pool."""
        pool, pages = reservation.pool, reservation.pages
        keys = [bytes(k) for k in keys][:len(pages)]
        with self._lock:
            for key, page in zip(keys, pages):
                self._drop(key)
                self._pages[key] = (pool, int(page))
                self._eviction.add(key, pool.page_bytes, hints)
            pool.free(pages[len(keys):])
        self.record_put(len(keys), len(keys) * pool.page_bytes)
        return len(keys)

    def cancel(self, reservation: Reservation) -> None:
        reservation.pool.free(reservation.pages)

    def lend(self, keys: Sequence[bytes]) -> Loan:
        """The stored pages of the hit prefix, readable in place until the loan is closed."""
        with self._lock:
            found = self._prefix(keys, touch=True)
            self._readers += 1
        nbytes = sum(p.page_bytes for p, _ in found)
        self.record_get(len(found), len(keys), nbytes)
        pools = {id(p): p for p, _ in found}
        if len(pools) == 1:
            pool = found[0][0]
            pages = np.array([page for _, page in found], dtype=np.int64)
            addresses, views = pool.addresses(pages), [pool.view(p) for p in pages]
        else:  # mixed page sizes: no address table
            addresses, views = None, [p.view(page) for p, page in found]
        return Loan(views, addresses, self._end_read, pinned=self.pinned)

    # --- the copying API -----------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], pages: Sequence[Buffer], hints: Hints | None = None) -> int:
        stored = 0
        batch: list[bytes] = []
        for key, page in zip(keys, pages):
            key = bytes(key)
            batch.append(key)
            with self._lock:
                if key in self._pages and not self._eviction.expired(key):
                    self._eviction.add(key, self._pages[key][0].page_bytes, hints)  # same content; new hints
                    stored += 1
                    continue
            view = byte_view(page)
            if len(view) > self.capacity_bytes:
                log.warning("%s: a %d-byte page is larger than the whole store", self.name, len(view))
                break
            res = self.reserve(len(view), 1, protect=batch)
            if res is None:
                break  # full of pinned pages: later pages of this prefix are useless anyway
            copy_into(res.pool.view(res.pages[0]), view)  # the one copy, outside the lock
            stored += self.commit(res, [key], hints)
        return stored

    def get(self, keys: Sequence[bytes], out: Sequence[Buffer]) -> int:
        with self._lock:
            found = self._prefix(keys, touch=True)
            self._readers += 1
        hits = nbytes = 0
        try:
            for (pool, page), buf in zip(found, out):
                view = byte_view(buf)
                if pool.page_bytes > len(view):
                    log.warning("%s: page of %d bytes does not fit a %d-byte buffer", self.name, pool.page_bytes,
                                len(view))
                    break
                copy_into(view, pool.view(page))  # a page evicted meanwhile stays intact until readers end
                hits, nbytes = hits + 1, nbytes + pool.page_bytes
        finally:
            self._end_read()
        self.record_get(hits, len(keys), nbytes)
        return hits

    def contains(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            return len(self._prefix(keys, touch=False))

    def delete(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            present = [bytes(k) for k in keys if bytes(k) in self._pages]
            for key in present:
                self._drop(key)
        return len(present)

    def stats(self) -> dict:
        with self._lock:
            used, pages = self._eviction.used, len(self._pages)
        return {**super().stats(), "used_bytes": used, "pages": pages, "capacity_bytes": self.capacity_bytes,
                "pinned": self.pinned}

    def close(self) -> None:
        with self._lock:
            self._pages.clear()
            self._deferred.clear()
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()
            self._eviction = EvictionOrder()

    # --- internals (callers hold the lock) --------------------------------------------------------

    def _pool(self, page_bytes: int) -> PagePool:
        pool = self._pools.get(page_bytes)
        if pool is None:
            for size in [s for s, p in self._pools.items() if not any(e[0] is p for e in self._pages.values())]:
                self._pools.pop(size).close()  # page sizes change with the model only: free the old pages
            pool = self._pools[page_bytes] = PagePool(page_bytes, self.capacity_bytes, pinned=self.pinned)
        return pool

    def _prefix(self, keys: Sequence[bytes], touch: bool) -> list[tuple[PagePool, int]]:
        found = []
        for key in keys:
            key = bytes(key)
            entry = self._pages.get(key)
            if entry is None:
                break
            if self._eviction.expired(key):
                self._drop(key)
                self.record_evict(1, entry[0].page_bytes, "ttl")
                break
            if touch:
                self._eviction.touch(key)
            found.append(entry)
        return found

    def _drop(self, key: bytes) -> None:
        entry = self._pages.pop(key, None)
        if entry is not None:
            self._eviction.remove(key)
            self._release(entry)

    def _release(self, entry: tuple[PagePool, int]) -> None:
        if self._readers:
            self._deferred.append(entry)
        else:
            entry[0].free([entry[1]])

    def _end_read(self) -> None:
        with self._lock:
            self._readers -= 1
            if not self._readers:
                for pool, page in self._deferred:
                    pool.free([page])
                self._deferred.clear()
