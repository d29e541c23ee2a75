"""Prefix reuse through any pdsdk store, for PdsdkConnector.

Keys are vLLM's own block hashes (chained from the prefix), namespaced by model, KV layout and TP
rank. One store page is one block across every layer and K/V plane. The scheduler keeps an index
of the hashes its workers saved (it cannot see a worker's memory store) and, when the store is
shared (anything but a process-local one), asks the store for the rest of the prefix, so engines
sharing a store reuse each other's pages. A page the store has dropped since is a load error,
which vLLM recomputes (`kv_load_failure_policy: recompute`).
Loads run on a thread and finish asynchronously; saves copy the new blocks out during
`wait_for_save` (a memcpy) and write them to the store on a thread, off the step.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from pdsdk.adapters.vllm.metadata import StorePages
from pdsdk.adapters.vllm.stats import StatsRecorder
from pdsdk.connectors.stores.factory import open_store
from pdsdk.connectors.stores.keys import KeySpace
from pdsdk.connectors.transports.staging import pack_spans

log = logging.getLogger(__name__)
INDEX_LIMIT = 1 << 20  # hashes the scheduler remembers (LRU)


class StoreIndex:
    """Scheduler side: which block hashes the workers have stored (most recently used last)."""

    def __init__(self, limit: int = INDEX_LIMIT):
        self._hashes: OrderedDict[bytes, None] = OrderedDict()
        self._limit = limit

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
        from pdsdk.connectors.stores.base import Backoff

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
    """Worker side: move whole blocks between the KV cache and the store."""

    def __init__(self, spec: Any, keyspace: KeySpace, tensors: list[Any], geometry: list[list[int]],
                 stats: StatsRecorder | None = None):
        self.store = open_store(spec)
        self.stats = stats or StatsRecorder()
        self.keyspace = keyspace
        from pdsdk.adapters.vllm.pages import region_bytes
        from pdsdk.connectors.transports.buffers import torch_view

        self.views = [torch_view(t.data_ptr(), region_bytes(t), str(t.device)) for t in tensors]
        self.geometry = geometry
        self.page_bytes = sum(planes * block_bytes for planes, _, _, block_bytes in geometry)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdsdk-store")
        self._loads: dict[str, tuple[Future, list[int]]] = {}

    def _spans(self, block_ids: list[int]) -> np.ndarray:
        """Block-major spans: block b's bytes of every layer and plane, then the next block."""
        rows = [(layer, plane * ps + b * bs, bb) for b in block_ids
                for layer, (planes, ps, bs, bb) in enumerate(self.geometry) for plane in range(planes)]
        return np.array(rows, dtype=np.int64).reshape(-1, 3)

    def _flat(self, n: int) -> Any:
        import torch

        return torch.empty(n * self.page_bytes, dtype=torch.uint8, device=self.views[0].device)

    # --- loads ---------------------------------------------------------------------------------

    def start_load(self, request_id: str, pages: StorePages) -> None:
        self._loads[request_id] = (self._pool.submit(self._load, pages), pages.block_ids)

    def _load(self, pages: StorePages) -> int:
        """Blocks loaded, as a prefix of `pages` (a miss ends it)."""
        start = time.monotonic()
        flat = self._flat(len(pages.block_ids))
        host = flat if flat.device.type == "cpu" else flat.cpu()
        out = list(host.numpy().reshape(len(pages.block_ids), self.page_bytes))
        hits = self.store.get(self.keyspace.keys(pages.block_hashes), out)
        if hits:
            if host is not flat:
                flat.copy_(host)
            pack_spans(self.views, self._spans(pages.block_ids[:hits]), flat, unpack=True)
        self.stats.time("store_load_seconds", time.monotonic() - start)
        return hits

    def finished_loads(self) -> tuple[set[str], set[int]]:
        """Requests whose load ended, and the blocks that could not be loaded (for recompute)."""
        done, errors = set(), set()
        for request_id, (future, blocks) in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[request_id]
            done.add(request_id)
            try:
                hits = future.result()
            except Exception as e:  # noqa: BLE001 - a store failure is a miss, recomputed by vLLM
                log.error("pdsdk: store load for request %s failed: %s", request_id, e)
                self.stats.add(store_load_failures=1)
                hits = 0
            self.stats.add(store_hits=hits, store_misses=len(blocks) - hits, store_load_bytes=hits * self.page_bytes)
            if hits < len(blocks):
                log.warning("pdsdk: store had %d of %d blocks for request %s; vLLM recomputes the rest",
                            hits, len(blocks), request_id)
                errors.update(blocks[hits:])
        return done, errors

    # --- saves ---------------------------------------------------------------------------------

    def save(self, pages: list[StorePages]) -> None:
        """Copy the blocks out now (they are in place after this step's forward), store them later."""
        block_ids = [b for p in pages for b in p.block_ids]
        hashes = [h for p in pages for h in p.block_hashes]
        if not block_ids:
            return
        flat = self._flat(len(block_ids))
        pack_spans(self.views, self._spans(block_ids), flat)
        self._pool.submit(self._put, hashes, flat)

    def _put(self, hashes: list[bytes], flat: Any) -> None:
        try:
            host = flat.cpu().numpy().reshape(len(hashes), self.page_bytes)
            stored = self.store.put(self.keyspace.keys(hashes), list(host))
            self.stats.add(store_saves=stored, store_save_bytes=stored * self.page_bytes)
        except Exception:  # noqa: BLE001 - a failed save is only a future miss
            log.exception("pdsdk: store save of %d blocks failed", len(hashes))
            self.stats.add(store_save_failures=1)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.store.close()
