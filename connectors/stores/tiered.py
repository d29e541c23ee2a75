"""`tiered`: an ordered list of stores, fastest first, acting as one.

Puts go to the first tier; what a tier evicts for room is demoted to the next one. A read walks
the prefix across tiers (page i may be in memory, page i+1 on disk) and promotes what it found
below the first tier back into it. Tiers are inclusive: a promoted page keeps its copy below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdsdk.connectors.stores.base import Buffer, Hints, Store, byte_view, log


class TieredStore(Store):
    def __init__(self, name: str = "tiered", tiers: Sequence[Any] = ()):
        super().__init__(name)
        if not tiers:
            raise ValueError('a tiered store needs tiers, e.g. {"tiered": ["memory", "disk"]}')
        from pdsdk.connectors.stores.factory import open_store

        self.tiers: list[Store] = []
        try:
            for tier in tiers:
                self.tiers.append(open_store(tier))
        except BaseException:
            self.close()
            raise
        for upper, lower in zip(self.tiers, self.tiers[1:]):
            upper.set_demote(self._demoter(lower))

    def _demoter(self, lower: Store):
        def demote(key: bytes, page: Buffer, hints: Hints) -> None:
            try:
                lower.put([key], [page], hints)
            except Exception:  # noqa: BLE001 - a failing lower tier loses the page, nothing more
                log.exception("%s: demotion to %s failed", self.name, lower.name)
                self.record_error()
        return demote

    def put(self, keys: Sequence[bytes], pages: Sequence[Buffer], hints: Hints | None = None) -> int:
        # A batch larger than a tier (which never evicts its own batch) goes on in the next one.
        stored = 0
        for tier in self.tiers:
            stored += tier.put(keys[stored:], pages[stored:], hints)
            if stored >= len(keys):
                break
        self.record_put(stored, 0)
        return stored

    def _walk(self, keys: Sequence[bytes], step) -> int:
        """Extend the hit prefix tier by tier: at each position the first tier that has the next
        page answers for as long a run as it holds. `step(tier_index, start)` returns a run length."""
        pos = 0
        while pos < len(keys):
            for i in range(len(self.tiers)):
                run = step(i, pos)
                if run:
                    pos += run
                    break
            else:
                break
        return pos

    def get(self, keys: Sequence[bytes], out: Sequence[Buffer]) -> int:
        nbytes = 0

        def step(i: int, pos: int) -> int:
            nonlocal nbytes
            run = self.tiers[i].get(keys[pos:], out[pos:])
            if run and i > 0:  # promote toward the first tier; the caller's buffers hold the pages
                self.tiers[0].put(keys[pos:pos + run], out[pos:pos + run])
            nbytes += sum(len(byte_view(o)) for o in out[pos:pos + run])
            return run

        hits = self._walk(keys, step)
        self.record_get(hits, len(keys), nbytes)
        return hits

    def prepare(self, page_bytes: int) -> None:
        for tier in self.tiers:
            tier.prepare(page_bytes)

    def lend(self, keys: Sequence[bytes]):
        """The first tier's prefix in place; the data path `get`s the rest (lower tiers, promoted)."""
        return self.tiers[0].lend(keys)

    def reserve(self, page_bytes: int, n: int, protect: Sequence[bytes] = ()):
        """New pages go to the first tier, as `put` sends them; its evictions demote as usual."""
        return self.tiers[0].reserve(page_bytes, n, protect)

    def contains(self, keys: Sequence[bytes]) -> int:
        return self._walk(keys, lambda i, pos: self.tiers[i].contains(keys[pos:]))

    def delete(self, keys: Sequence[bytes]) -> int:
        present = 0
        for key in keys:
            present += any([tier.delete([key]) for tier in self.tiers])  # a list: delete in every tier
        return present

    def stats(self) -> dict:
        return {**super().stats(), "tiers": [t.stats() for t in self.tiers]}

    def close(self) -> None:
        for tier in getattr(self, "tiers", []):
            tier.close()
