"""`memory`: pages in this process's RAM, bounded in bytes, evicted by hint-aware LRU.

Copies happen outside the lock (one into the store on put, one into the caller's buffer on get),
so threads copying different pages run in parallel; the lock only guards the index. Buffers of
evicted or deleted pages are reused for new pages of the same size: fresh memory costs a page
fault per 4 KiB on first touch, which alone cut puts to a fifth of copy speed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from pdsdk.connectors.stores.base import Buffer, Hints, Store, byte_view, copy_into, log
from pdsdk.connectors.stores.retention import Retention


class MemoryStore(Store):
    def __init__(self, name: str = "memory", capacity_bytes: int = 1 << 30):
        super().__init__(name)
        self.capacity_bytes = int(capacity_bytes)
        self._pages: dict[bytes, bytearray] = {}
        self._retention = Retention()
        self._lock = threading.Lock()
        self._free: dict[int, list[bytearray]] = {}  # reusable page buffers by size
        self._free_bytes = 0
        self._readers = 0  # gets copying outside the lock: buffers dropped meanwhile are not reused

    def put(self, keys: Sequence[bytes], pages: Sequence[Buffer], hints: Hints | None = None) -> int:
        stored = nbytes = 0
        batch: set[bytes] = set()
        for key, page in zip(keys, pages):
            key = bytes(key)
            batch.add(key)
            with self._lock:
                if key in self._pages and not self._retention.expired(key):
                    self._retention.add(key, len(self._pages[key]), hints)  # same content; new hints
                    stored += 1
                    continue
            view = byte_view(page)
            data = self._take(len(view))
            if data is None:
                data = bytearray(view)  # the one copy, outside the lock
            else:
                copy_into(data, view)
            if not self._insert(key, data, hints, batch):
                break  # full of pinned pages: later pages of this prefix are useless anyway
            stored, nbytes = stored + 1, nbytes + len(data)
        self._record_put(stored, nbytes)
        return stored

    def _take(self, size: int) -> bytearray | None:
        with self._lock:
            free = self._free.get(size)
            if not free:
                return None
            self._free_bytes -= size
            return free.pop()

    def _recycle(self, data: bytearray) -> None:
        """Keep a dropped page's buffer for reuse (caller holds the lock), within capacity;
        buffers of other sizes make way (page sizes change rarely: with the model)."""
        if self._readers:
            return
        for size in [n for n in self._free if n != len(data)]:
            while self._free[size] and self._retention.used + self._free_bytes + len(data) > self.capacity_bytes:
                self._free[size].pop()
                self._free_bytes -= size
        if self._retention.used + self._free_bytes + len(data) <= self.capacity_bytes:
            self._free.setdefault(len(data), []).append(data)
            self._free_bytes += len(data)

    def _insert(self, key: bytes, data: bytearray, hints: Hints | None, batch: set[bytes]) -> bool:
        if len(data) > self.capacity_bytes:
            log.warning("%s: a %d-byte page is larger than the whole store", self.name, len(data))
            return False
        with self._lock:
            self._drop(key)
            need = self._retention.used + len(data) - self.capacity_bytes
            victims = self._retention.victims(max(need, 0), batch)  # expired pages go in any case
            demoted = [(v.key, self._pages.pop(v.key), v.hints) for v in victims if v.hints is not None]
            for v in victims:
                old = self._pages.pop(v.key, None)
                if old is not None:
                    self._recycle(old)
            if self._retention.used + len(data) > self.capacity_bytes:
                ok = False
            else:
                self._pages[key] = data
                self._retention.add(key, len(data), hints)
                ok = True
        self._report_evictions(victims)
        if self._demote is not None:
            for item in demoted:
                self._demote(*item)
        return ok

    def _drop(self, key: bytes) -> None:
        data = self._pages.pop(key, None)
        if data is not None:
            self._retention.remove(key)
            self._recycle(data)

    def _prefix(self, keys: Sequence[bytes], touch: bool) -> list[bytearray]:
        """The stored pages of the hit prefix (caller holds the lock)."""
        found = []
        for key in keys:
            key = bytes(key)
            data = self._pages.get(key)
            if data is None:
                break
            if self._retention.expired(key):
                self._drop(key)
                self._record_evict(1, len(data), "ttl")
                break
            if touch:
                self._retention.touch(key)
            found.append(data)
        return found

    def get(self, keys: Sequence[bytes], out: Sequence[Buffer]) -> int:
        with self._lock:
            found = self._prefix(keys, touch=True)
            self._readers += 1
        hits = nbytes = 0
        try:
            for data, buf in zip(found, out):
                view = byte_view(buf)
                if len(data) > len(view):
                    log.warning("%s: page of %d bytes does not fit a %d-byte buffer", self.name, len(data),
                                len(view))
                    break
                copy_into(view, data)  # a page evicted meanwhile stays intact: its buffer is not reused
                hits, nbytes = hits + 1, nbytes + len(data)
        finally:
            with self._lock:
                self._readers -= 1
        self._record_get(hits, len(keys), nbytes)
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
            used, pages = self._retention.used, len(self._pages)
        return {**super().stats(), "used_bytes": used, "pages": pages, "capacity_bytes": self.capacity_bytes}

    def close(self) -> None:
        with self._lock:
            self._pages.clear()
            self._free.clear()
            self._free_bytes = 0
            self._retention = Retention()
