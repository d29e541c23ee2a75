"""The store data path: whole KV blocks between an engine's paged KV cache and any pdsdk store.

One store page is one block across every layer and K/V plane (block-major). On a GPU:
- a load asks the store to lend its pages in place (the `memory` store's pinned pages) or copies
  them into a pinned staging page; one copy-table kernel then writes them into the blocks, on the
  path's own load stream, after an event that orders it behind the engine's earlier work;
- a save gathers the blocks into a GPU staging area in one kernel on the save stream; the engine's
  stream waits for that gather only (an event, no host wait), so the blocks may be reused at once;
  a thread then copies the area into pinned pages the store reserved (or staging pages it copies
  from) and commits them. When the staging area or the backlog is full the save is skipped (counted);
- loads and saves have their own threads and streams: a load never waits behind a save.
On a host the same tables run as memmove loops. Nothing here waits on a GPU inside the engine's step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from pdsdk.adapters.common.page_copy import copy_table, dma_copy
from pdsdk.connectors.stores.common.pool import PagePool

log = logging.getLogger(__name__)
GPU_STAGING_BYTES = 1 << 30  # saves in flight on the GPU (an 8B model's 4096 tokens are 576 MiB)
HOST_STAGING_BYTES = 1 << 30  # pinned pages for stores that copy (every store but `memory`)
SAVE_BACKLOG = 64  # saves queued on a host before new ones are skipped
GATHER_PROGRAMS = 1024  # a GPU-to-GPU gather may use the whole device: it is short


class BlockLayout:
    """Where a block's bytes sit in each layer's KV cache, as rows of a copy table."""

    def __init__(self, bases: Sequence[int], geometry: Sequence[Sequence[int]], device: int | None):
        # geometry per layer: [planes, plane_stride, block_stride, block_bytes] (pdsdk.adapters.vllm.pages)
        row_base, row_stride, sizes = [], [], []
        for base, (planes, plane_stride, block_stride, block_bytes) in zip(bases, geometry):
            for plane in range(planes):
                row_base.append(base + plane * plane_stride)
                row_stride.append(block_stride)
                sizes.append(block_bytes)
        self.row_base = np.array(row_base, dtype=np.int64)
        self.row_stride = np.array(row_stride, dtype=np.int64)
        self.row_sizes = np.array(sizes, dtype=np.int64)
        self.page_offsets = np.concatenate(([0], np.cumsum(self.row_sizes)[:-1])).astype(np.int64)
        self.page_bytes = int(self.row_sizes.sum())
        self.device = device

    def block_rows(self, block_ids: Sequence[int]) -> np.ndarray:
        """Addresses of every row of the given blocks, block-major (as the pages hold them)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return (self.row_base[None, :] + ids[:, None] * self.row_stride[None, :]).ravel()

    def page_rows(self, page_addresses: np.ndarray) -> np.ndarray:
        return (np.asarray(page_addresses, dtype=np.int64)[:, None] + self.page_offsets[None, :]).ravel()

    def sizes(self, n: int) -> np.ndarray:
        return np.tile(self.row_sizes, n)


class StoreIO:
    """Loads and saves of whole blocks for one engine worker (one TP rank)."""

    def __init__(self, store: Any, layout: BlockLayout, count: Callable[..., None] | None = None,
                 gpu_staging_bytes: int = GPU_STAGING_BYTES, host_staging_bytes: int = HOST_STAGING_BYTES):
        self.store = store
        self.layout = layout
        self.device = layout.device
        self.count = count or (lambda **kw: None)  # count(store_saves_skipped=1, ...)
        self.staging = PagePool(layout.page_bytes, host_staging_bytes, pinned=self.device is not None)
        if self.device is not None:  # pin host memory before serving, as vLLM's own offload does
            store.prepare(layout.page_bytes)
            self.staging.fill()
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="pdsdk-store-load")
        self._save_pool = ThreadPoolExecutor(1, thread_name_prefix="pdsdk-store-save")
        self._saves_queued = 0
        self._lock = threading.Lock()
        if self.device is not None:
            import torch

            from pdsdk.connectors.transports.common.staging import StagingBuffer

            from pdsdk.adapters.common.page_copy import triton_usable

            self._torch = torch
            triton_usable(self.device)  # compile the copy kernel now, not in the first step that saves
            self.gpu_staging = StagingBuffer(gpu_staging_bytes, f"cuda:{self.device}")
            self._load_stream = torch.cuda.Stream(self.device)
            self._save_stream = torch.cuda.Stream(self.device)

    # --- loads -----------------------------------------------------------------------------------

    def load(self, block_ids: Sequence[int], keys: Sequence[bytes]) -> Future:
        """Fill `block_ids` from the pages under `keys`; the future gives how many blocks (a prefix) landed."""
        after = self._engine_event()
        return self._load_pool.submit(self._load, list(block_ids), list(keys), after)

    def _load(self, block_ids: list[int], keys: list[bytes], after: Any) -> int:
        loan = self.store.lend(keys)
        staged = None
        try:
            if loan is not None and (loan.addresses is None or (self.device is not None and not loan.pinned)):
                loan.close()  # not addressable in place (pageable memory for a GPU): copy instead
                loan = None
            src = loan.addresses if loan is not None else np.zeros(0, dtype=np.int64)
            if len(src) < len(keys):
                staged = self.staging.alloc(len(keys) - len(src))
                if staged is not None:
                    got = self.store.get(keys[len(src):], [self.staging.view(p) for p in staged])
                    src = np.concatenate((src, self.staging.addresses(staged[:got])))
            hits = len(src)
            if hits:
                dst = self.layout.block_rows(block_ids[:hits])
                self._run(dst, self.layout.page_rows(src), self.layout.sizes(hits), after, self._stream("load"))
            return hits
        finally:
            if loan is not None:
                loan.close()
            if staged is not None:
                self.staging.free(staged)

    # --- saves -----------------------------------------------------------------------------------

    def save(self, block_ids: Sequence[int], keys: Sequence[bytes], done: Callable[[int], None]) -> bool:
        """Store the blocks (computed by the engine's work queued so far) under `keys`, off the step;
        `done(stored)` runs on the save thread once they landed. False: skipped under pressure."""
        n = len(block_ids)
        if not n:
            return True
        with self._lock:
            if self._saves_queued >= SAVE_BACKLOG:
                self.count(store_saves_skipped=n)
                return False
            self._saves_queued += 1
        try:
            if self.device is None:
                staged = self._host_pages(n, keys)
                if staged is None:
                    raise _Skip
                copy_table(self.layout.page_rows(staged[1]), self.layout.block_rows(block_ids), self.layout.sizes(n),
                           None)
                self._save_pool.submit(self._commit_host, staged, list(keys), done)
            else:
                area = self._gather(block_ids)
                if area is None:
                    raise _Skip
                self._save_pool.submit(self._commit_gpu, area, list(keys), done)
            return True
        except _Skip:
            with self._lock:
                self._saves_queued -= 1
            self.count(store_saves_skipped=n)
            return False

    def _host_pages(self, n: int, keys: Sequence[bytes]) -> tuple[Any, np.ndarray] | None:
        """Pages to write `n` blocks into: reserved in the store itself when it keeps them in host memory,
        else staging pages (then copied by `put`). (reservation or staging ids, page addresses)."""
        res = self.store.reserve(self.layout.page_bytes, n, protect=keys)
        if res is not None and (self.device is None or res.pinned):
            return res, res.addresses
        if res is not None:
            res.cancel()
        staged = self.staging.alloc(n)
        return None if staged is None else (staged, self.staging.addresses(staged))

    def _finish_host(self, staged: tuple[Any, np.ndarray], keys: list[bytes]) -> int:
        what, _ = staged
        if isinstance(what, np.ndarray):
            try:
                return self.store.put(keys, [self.staging.view(p) for p in what])
            finally:
                self.staging.free(what)
        return what.commit(keys)

    def _commit_host(self, staged: tuple[Any, np.ndarray], keys: list[bytes], done: Callable[[int], None]) -> None:
        stored = 0
        try:
            stored = self._finish_host(staged, keys)
        except Exception:  # noqa: BLE001 - a failed save is only a future miss
            log.exception("pdsdk: store save of %d blocks failed", len(keys))
            self.count(store_save_failures=1)
        finally:
            with self._lock:
                self._saves_queued -= 1
            done(stored)

    def _gather(self, block_ids: Sequence[int]) -> tuple[int, int, Any] | None:
        """Gather the blocks into a GPU staging area on the save stream; the engine's stream waits for it."""
        torch = self._torch
        nbytes = len(block_ids) * self.layout.page_bytes
        offset = self.gpu_staging.alloc(nbytes)
        if offset is None:
            return None
        after = self._engine_event()
        base = self.gpu_staging.region.addr + offset
        pages = base + np.arange(len(block_ids), dtype=np.int64) * self.layout.page_bytes
        gathered = self._run(self.layout.page_rows(pages), self.layout.block_rows(block_ids),
                             self.layout.sizes(len(block_ids)), after, self._save_stream, wait=False,
                             programs=GATHER_PROGRAMS)
        torch.cuda.current_stream(self.device).wait_event(gathered)
        return offset, nbytes, gathered

    def _commit_gpu(self, area: tuple[int, int, Any], keys: list[bytes], done: Callable[[int], None]) -> None:
        offset, nbytes, gathered = area
        stored = 0
        try:
            staged = self._host_pages(len(keys), keys)
            if staged is None:
                self.count(store_saves_skipped=len(keys))
                return
            src = self.gpu_staging.region.addr + offset + np.arange(len(keys), dtype=np.int64) * self.layout.page_bytes
            sizes = np.full(len(keys), self.layout.page_bytes, dtype=np.int64)
            self._run(staged[1], src, sizes, gathered, self._save_stream, dma=True)
            stored = self._finish_host(staged, keys)
        except Exception:  # noqa: BLE001 - a failed save is only a future miss
            log.exception("pdsdk: store save of %d blocks failed", len(keys))
            self.count(store_save_failures=1)
        finally:
            self.gpu_staging.free(offset, nbytes)
            with self._lock:
                self._saves_queued -= 1
            done(stored)

    # --- copies ----------------------------------------------------------------------------------

    def _engine_event(self) -> Any:
        """An event after the engine's work queued so far (None on a host)."""
        if self.device is None:
            return None
        event = self._torch.cuda.Event()
        event.record(self._torch.cuda.current_stream(self.device))
        return event

    def _stream(self, kind: str) -> Any:
        return None if self.device is None else (self._load_stream if kind == "load" else self._save_stream)

    def _run(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, after: Any, stream: Any,
             wait: bool = True, programs: int | None = None, dma: bool = False) -> Any:
        """Run a copy table; on a GPU on `stream` after the event `after`, then wait for it unless `wait`
        is False (the event that marks its end is returned)."""
        if self.device is None:
            copy_table(dst, src, sizes, None)
            return None
        torch = self._torch
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            if dma:
                dma_copy(dst, src, sizes, self.device)
            else:
                copy_table(dst, src, sizes, self.device, **({"programs": programs} if programs else {}))
            end = torch.cuda.Event()
            end.record(stream)
        if wait:
            end.synchronize()  # on this path's own thread, never the engine's
        return end

    def close(self) -> None:
        self._load_pool.shutdown(wait=True, cancel_futures=True)
        self._save_pool.shutdown(wait=True, cancel_futures=True)
        self.staging.close()


class _Skip(Exception):
    """A save that does not fit now."""
