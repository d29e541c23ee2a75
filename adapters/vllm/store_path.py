"""Prefix reuse through any pdsdk store, for PdsdkConnector.

Keys are vLLM's own block hashes (chained from the prefix), namespaced by model, KV layout and TP
rank. One store page is one block across every layer and K/V plane. The scheduler keeps an index
of the hashes its workers saved (it cannot see a worker's memory store) and, when the store is
shared (anything but a process-local one), asks the store for the rest of the prefix, so engines
sharing a store reuse each other's pages. A page the store has dropped since is a load error,
which vLLM recomputes (`kv_load_failure_policy: recompute`).
The data path itself (pinned pages, copy kernels on the connector's own streams, loads ahead of
saves) is adapters/common/store_io.py; the scheduler's index learns a block only once its save landed.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from pdsdk.adapters.vllm.metadata import StorePages
from pdsdk.adapters.vllm.stats import StatsRecorder
from pdsdk.connectors.stores.common.keys import KeySpace
from pdsdk.connectors.stores.factory import open_store

log = logging.getLogger(__name__)
INDEX_LIMIT = 1 << 20  # hashes the scheduler remembers (LRU)


class StoreIndex:
    """Scheduler side: which block hashes the workers have stored (most recently used last)."""

    def __init__(self, limit: int = INDEX_LIMIT):
        self._hashes: OrderedDict[bytes, None] = OrderedDict()
        self._limit = limit

    def __contains__(self, h: bytes) -> bool:
        return h in self._hashes

    def hit_prefix(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            self._hashes.move_to_end(h)
            n += 1
        return n

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self._limit:
            self._hashes.popitem(last=False)


# Stores whose pages live in this process only: the scheduler cannot see what a worker stored
# there, so it keeps to its own index. `lmcache`'s CPU tier belongs to one store instance too.
PROCESS_LOCAL = ("memory", "lmcache")
LOOKUP_SLOW_S = 0.1  # a shared-store lookup slower than this pauses lookups (with backoff)


def shared_spec(spec: Any) -> Any:
    """The part of a store config that other engines can see (a StoreSpec), or None: the store itself
    unless it is process-local; for `tiered`, its shared tiers (one, or a tiered store of several)."""
    from pdsdk.config import StoreSpec

    if spec is None:
        return None
    if spec.name == "tiered" and spec.tiers:
        tiers = [t for t in (shared_spec(t) for t in spec.tiers) if t is not None]
        if len(tiers) <= 1:
            return tiers[0] if tiers else None
        return StoreSpec(name="tiered", options=spec.options, tiers=tiers)
    return None if spec.name in PROCESS_LOCAL else spec


def lookup_only(spec: Any) -> Any:
    """The config of a store opened only to ask `contains`: a Mooncake Store client of the scheduler
    contributes no memory to the pool (segment 0), so no other engine's pages land in it."""
    import msgspec

    if spec.name == "tiered" and spec.tiers:
        return msgspec.structs.replace(spec, tiers=[lookup_only(t) for t in spec.tiers])
    if spec.name == "mooncake":
        return msgspec.structs.replace(spec, options={**spec.options, "segment_bytes": 0})
    return spec


class StoreLookup:
    """Scheduler side: ask a shared store (redis, mooncake, a disk directory, ...) for the longest
    stored prefix, so an engine reuses pages other engines saved. One batched `contains` per TP
    rank's key namespace (the workers publish theirs in the handshake; the keys are the ones the
    workers save under). It never raises: a failing, unreachable or slow store is a miss, and
    lookups pause (1 s, doubling to 30 s) so an outage costs the scheduler nothing per step."""

    def __init__(self, spec: Any, stats: StatsRecorder | None = None, slow_s: float = LOOKUP_SLOW_S):
        from pdsdk.connectors.stores.common.backoff import Backoff

        self.spec = spec
        self.stats = stats or StatsRecorder()
        self.slow_s = slow_s
        self.keyspaces: list[KeySpace] = []
        self._backoff = Backoff(first_s=1.0, max_s=30.0)
        try:
            self.store = open_store(lookup_only(spec))
        except Exception as e:  # noqa: BLE001 - no lookups, but the engine runs (its own index still works)
            log.warning("pdsdk: cannot open the shared store %s for scheduler lookups (%s: %s); only pages "
                        "this engine saved are found", spec.name, type(e).__name__, e)
            self.store = None

    def set_keyspaces(self, keyspaces: list[KeySpace]) -> None:
        self.keyspaces = list(dict.fromkeys(keyspaces))  # MLA: one namespace shared by every rank

    @property
    def ready(self) -> bool:
        return self.store is not None and bool(self.keyspaces)

    def hit_prefix(self, hashes: list[bytes]) -> int:
        """Length of the prefix of `hashes` stored for every TP rank (0 on any trouble)."""
        if not hashes or not self.ready or not self._backoff.ready():
            return 0
        start = time.monotonic()
        try:
            n = len(hashes)
            for keyspace in self.keyspaces:
                n = min(n, self.store.contains(keyspace.keys(hashes[:n])))
                if n == 0:
                    break
        except Exception as e:  # noqa: BLE001 - a store that raises is a miss, never an engine error
            if not self._backoff.down:
                log.warning("pdsdk: shared store lookup failed (%s: %s); pausing lookups", type(e).__name__, e)
            self._backoff.failed()
            self.stats.add(store_lookup_errors=1)
            return 0
        elapsed = time.monotonic() - start
        self.stats.add(store_lookups=1, store_lookup_blocks=n)
        self.stats.time("store_lookup_seconds", elapsed)
        if elapsed > self.slow_s:
            if not self._backoff.down:
                log.warning("pdsdk: shared store lookup took %.0f ms (budget %.0f ms); pausing lookups",
                            elapsed * 1e3, self.slow_s * 1e3)
            self._backoff.failed()
            self.stats.add(store_lookup_errors=1)
        else:
            self._backoff.succeeded()
        return n

    def close(self) -> None:
        if self.store is not None:
            try:
                self.store.close()
            except Exception:
                log.debug("pdsdk: closing the lookup store failed", exc_info=True)


class StoreIO:
    """Worker side: vLLM's blocks and hashes on the shared store data path (adapters/common/store_io.py).
    Loads report when they end; saves report the hashes that landed (`take_saved`), which reach the
    scheduler's index through the connector stats: a block is claimed only once its save has landed."""

    def __init__(self, spec: Any, keyspace: KeySpace, tensors: list[Any], geometry: list[list[int]],
                 stats: StatsRecorder | None = None):
        from pdsdk.adapters.common.store_io import BlockLayout, StoreIO as PathIO

        self.store = open_store(spec)
        self.stats = stats or StatsRecorder()
        self.keyspace = keyspace
        first = tensors[0]
        device = None if first.device.type == "cpu" else (first.device.index or 0)
        layout = BlockLayout([t.data_ptr() for t in tensors], geometry, device)
        self.page_bytes = layout.page_bytes
        self.path = PathIO(self.store, layout, count=self.stats.add)
        self._loads: dict[str, tuple[Future, list[int], float]] = {}

    # --- loads ---------------------------------------------------------------------------------

    def start_load(self, request_id: str, pages: StorePages) -> None:
        future = self.path.load(pages.block_ids, self.keyspace.keys(pages.block_hashes))
        self._loads[request_id] = (future, pages.block_ids, time.monotonic())

    def finished_loads(self) -> tuple[set[str], set[int]]:
        """Requests whose load ended, and the blocks that could not be loaded (for recompute)."""
        done, errors = set(), set()
        for request_id, (future, blocks, start) in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[request_id]
            done.add(request_id)
            try:
                hits = future.result()
            except Exception as e:  # noqa: BLE001 - a store failure is a miss, recomputed by vLLM
                log.error("pdsdk: store load for request %s failed: %s: %s", request_id, type(e).__name__, e)
                self.stats.add(store_load_failures=1)
                hits = 0
            self.stats.time("store_load_seconds", time.monotonic() - start)
            self.stats.add(store_hits=hits, store_misses=len(blocks) - hits, store_load_bytes=hits * self.page_bytes)
            if hits < len(blocks):
                log.warning("pdsdk: store had %d of %d blocks for request %s; vLLM recomputes the rest",
                            hits, len(blocks), request_id)
                errors.update(blocks[hits:])
        return done, errors

    # --- saves ---------------------------------------------------------------------------------

    def save(self, pages: list[StorePages]) -> None:
        """This step's new full blocks, in one batch: gathered now (on a GPU: queued on the save stream),
        written to the store off the step."""
        block_ids = [b for p in pages for b in p.block_ids]
        hashes = [h for p in pages for h in p.block_hashes]
        if block_ids:
            self.path.save(block_ids, self.keyspace.keys(hashes), lambda stored: self._landed(hashes[:stored]))

    def _landed(self, hashes: list[bytes]) -> None:
        self.stats.add(store_saves=len(hashes), store_save_bytes=len(hashes) * self.page_bytes)
        self.stats.saved(hashes)

    def close(self) -> None:
        self.path.close()
        self.store.close()
