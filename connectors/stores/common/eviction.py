"""Eviction order shared by the stores that evict themselves (memory, disk), honouring L6 hints.

Order under pressure: expired pages, then pages marked not worth keeping (keep=False), then by
priority (low first), then least recently used. Pinned pages are never chosen while they live:
`ttl_s` is every page's lifetime, and a pinned page without one stays until deleted.
Not thread-safe: the owning store calls it under its own lock.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import NamedTuple

import msgspec

from pdsdk.connectors.stores.base import Hints

DEFAULT_HINTS = Hints()


class Victim(NamedTuple):
    key: bytes
    nbytes: int
    reason: str  # "capacity" or "ttl"
    hints: Hints | None  # for demotion; None when the page is dead (expired)


class _Entry:
    __slots__ = ("nbytes", "rank", "pin", "expires", "hints")

    def __init__(self, nbytes: int, hints: Hints, now: float):
        self.nbytes = nbytes
        self.hints = hints
        # Buckets sort ascending: (keep, priority); False < True puts keep=False first.
        self.rank = (hints.keep, hints.priority)
        self.pin = hints.pin
        self.expires = now + hints.ttl_s if hints.ttl_s is not None else None


class EvictionOrder:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._entries: dict[bytes, _Entry] = {}
        self._buckets: dict[tuple[bool, int], OrderedDict[bytes, None]] = {}  # evictable, LRU first
        self._expiry: list[tuple[float, bytes]] = []  # heap, validated lazily against the entry
        self.used = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def add(self, key: bytes, nbytes: int, hints: Hints | None = None, *, expires: float | None = None) -> None:
        """Track a page (again: new hints replace the old ones). `expires` restores an absolute
        deadline, on this clock, for pages found on reopen."""
        self.remove(key)
        now = self._clock()
        entry = _Entry(nbytes, hints or DEFAULT_HINTS, now)
        if expires is not None:
            entry.expires = expires
        self._entries[key] = entry
        self.used += nbytes
        if not entry.pin:
            self._buckets.setdefault(entry.rank, OrderedDict())[key] = None
        if entry.expires is not None:
            heapq.heappush(self._expiry, (entry.expires, key))

    def touch(self, key: bytes) -> None:
        entry = self._entries.get(key)
        if entry is not None and not entry.pin:
            self._buckets[entry.rank].move_to_end(key)

    def expired(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.expires is not None and entry.expires <= self._clock()

    def expires_at(self, key: bytes) -> float | None:
        entry = self._entries.get(key)
        return entry.expires if entry else None

    def remove(self, key: bytes) -> int | None:
        """Stop tracking `key`; returns its size, or None when it was not tracked."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.used -= entry.nbytes
        if not entry.pin:
            bucket = self._buckets[entry.rank]
            del bucket[key]
            if not bucket:
                del self._buckets[entry.rank]
        return entry.nbytes

    def pop_expired(self) -> list[tuple[bytes, int]]:
        """Remove and return every page whose lifetime has ended."""
        now, out = self._clock(), []
        while self._expiry and self._expiry[0][0] <= now:
            deadline, key = heapq.heappop(self._expiry)
            entry = self._entries.get(key)
            if entry is not None and entry.expires == deadline:
                out.append((key, self.remove(key)))
        return out

    def victims(self, need: int, protect: Collection[bytes] = ()) -> list[Victim]:
        """Remove and return pages to free at least `need` bytes, never those in `protect` (the
        batch being stored: evicting its own first pages would break its prefix). Frees less
        when only pinned or protected pages are left."""
        out = [Victim(k, n, "ttl", None) for k, n in self.pop_expired()]
        freed = sum(v.nbytes for v in out)
        chosen = []
        for rank in sorted(self._buckets):
            for key in self._buckets[rank]:
                if freed >= need:
                    break
                if key not in protect:
                    chosen.append(key)
                    freed += self._entries[key].nbytes
            if freed >= need:
                break
        for key in chosen:
            entry = self._entries[key]
            self.remove(key)
            out.append(Victim(key, entry.nbytes, "capacity", self._remaining(entry)))
        return out

    def _remaining(self, entry: _Entry) -> Hints:
        """The hints a demoted page carries to the next tier (what is left of its lifetime)."""
        if entry.expires is None:
            return entry.hints
        return msgspec.structs.replace(entry.hints, ttl_s=max(entry.expires - self._clock(), 1e-3))
