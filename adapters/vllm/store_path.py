"""Prefix reuse through any pdsdk store, for PdsdkConnector.

Keys are vLLM's own block hashes (chained from the prefix), namespaced by model, KV layout and TP
rank. One store page is one block across every layer and K/V plane. The scheduler keeps an index
of the hashes its workers saved (it cannot see a worker's memory store); a page the store has
dropped since is a load error, which vLLM recomputes (`kv_load_failure_policy: recompute`).
Loads run on a thread and finish asynchronously; saves copy the new blocks out during
`wait_for_save` (a memcpy) and write them to the store on a thread, off the step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from pdsdk.adapters.vllm.metadata import StorePages
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


class StoreIO:
    """Worker side: move whole blocks between the KV cache and the store."""

    def __init__(self, spec: Any, keyspace: KeySpace, tensors: list[Any], geometry: list[list[int]]):
        self.store = open_store(spec)
        self.keyspace = keyspace
        from pdsdk.adapters.vllm.worker import region_bytes
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
        flat = self._flat(len(pages.block_ids))
        host = flat if flat.device.type == "cpu" else flat.cpu()
        out = list(host.numpy().reshape(len(pages.block_ids), self.page_bytes))
        hits = self.store.get(self.keyspace.keys(pages.block_hashes), out)
        if hits:
            if host is not flat:
                flat.copy_(host)
            pack_spans(self.views, self._spans(pages.block_ids[:hits]), flat, unpack=True)
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
                hits = 0
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
            self.store.put(self.keyspace.keys(hashes), list(host))
        except Exception:  # noqa: BLE001 - a failed save is only a future miss
            log.exception("pdsdk: store save of %d blocks failed", len(hashes))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.store.close()
