"""A host page pool: fixed-size pages in a few large chunks of host memory, pinned for a GPU when asked.

The `memory` store keeps its pages here and the store data path stages through it, so a GPU copies
straight between its KV cache and these pages (pinned memory moves at the link's full speed,
pageable at a tenth). Chunks are allocated as pages are first needed, up to `capacity_bytes`;
a freed page is reused before new memory is touched. Thread-safe.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

CHUNK_BYTES = 1 << 30  # pinning cost and fragmentation are per chunk; 1 GiB is a power of two for torch
ALIGN = 4096


def can_pin() -> bool:
    """True where torch sees a CUDA device (pinned memory only pays off for a GPU)."""
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


class PagePool:
    def __init__(self, page_bytes: int, capacity_bytes: int, pinned: bool = False, chunk_bytes: int = CHUNK_BYTES):
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, not {page_bytes}")
        self.page_bytes = int(page_bytes)
        self.capacity = max(0, int(capacity_bytes) // self.page_bytes)  # pages
        self.pinned = bool(pinned)
        self.chunk_pages = max(1, min(int(chunk_bytes) // self.page_bytes, self.capacity or 1))
        self._chunks: list[np.ndarray] = []  # (chunk_pages, page_bytes) uint8 views
        self._owners: list[Any] = []  # what keeps each chunk's memory alive (numpy or pinned torch)
        self._bases = np.zeros(0, dtype=np.int64)
        self._free: list[int] = []
        self._growing = 0  # pages of a chunk being allocated outside the lock
        self._lock = threading.Lock()
        self._grown = threading.Condition(self._lock)

    @property
    def allocated(self) -> int:
        """Pages backed by memory now (in use or free)."""
        return sum(len(c) for c in self._chunks)

    @property
    def free_pages(self) -> int:
        return len(self._free) + max(0, self.capacity - self.allocated - self._growing)

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` page ids, or None when the pool cannot hold `n` more pages. New memory is allocated (and
        pinned: ~0.3 s per GiB) outside the lock, one chunk ahead on a thread: frees never wait for it, and
        an allocation waits only when it needs the chunk on its way."""
        while True:
            with self._lock:
                if len(self._free) >= n:
                    taken = self._free[len(self._free) - n:]
                    del self._free[len(self._free) - n:]
                    ahead = self._grow_pages() if self.pinned and len(self._free) < self.chunk_pages // 2 else 0
                    break
                if self._growing:  # a chunk is on its way: wait for it rather than report the pool full
                    self._grown.wait()
                    continue
                pages = self._grow_pages()
                if not pages:
                    return None
            self._grow(pages)
        if ahead:
            threading.Thread(target=self._grow, args=(ahead,), name="pdsdk-pool-grow", daemon=True).start()
        return np.asarray(taken, dtype=np.int64)

    def fill(self) -> None:
        """Allocate the whole capacity now (pinned memory is best taken before serving starts)."""
        while True:
            with self._lock:
                while self._growing:
                    self._grown.wait()
                pages = self._grow_pages()
            if not pages:
                return
            self._grow(pages)

    def free(self, pages: Any) -> None:
        with self._lock:
            self._free.extend(int(p) for p in pages)

    def _grow_pages(self) -> int:
        """Pages of the next chunk, counted as growing (caller holds the lock); 0 at capacity or while
        another chunk is on its way."""
        if self._growing:
            return 0
        pages = min(self.chunk_pages, self.capacity - self.allocated)  # the last chunk may be shorter
        self._growing = max(pages, 0)
        return self._growing

    def _chunk(self, pages: int) -> tuple[Any, np.ndarray]:
        nbytes = pages * self.page_bytes
        if self.pinned:
            import torch

            owner = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            return owner, owner.numpy()
        owner = np.empty(nbytes + ALIGN, dtype=np.uint8)
        start = (-owner.ctypes.data) % ALIGN  # page-aligned: faster copies
        return owner, owner[start:start + nbytes]

    def _grow(self, pages: int) -> None:
        chunk = None
        try:
            chunk = self._chunk(pages)
        finally:  # a failed allocation (out of memory) must not leave waiters behind
            with self._lock:
                if chunk is not None:
                    owner, raw = chunk
                    first = len(self._chunks) * self.chunk_pages
                    self._owners.append(owner)
                    self._chunks.append(raw.reshape(pages, self.page_bytes))
                    self._bases = np.append(self._bases, raw.ctypes.data)
                    # Lowest ids on top of the stack: a fresh pool hands out consecutive pages (long copy runs).
                    self._free.extend(range(first + pages - 1, first - 1, -1))
                self._growing = 0
                self._grown.notify_all()

    def view(self, page: int) -> np.ndarray:
        """The page's bytes (a writable uint8 view, no copy)."""
        chunk, row = divmod(int(page), self.chunk_pages)
        return self._chunks[chunk][row]

    def addresses(self, pages: np.ndarray) -> np.ndarray:
        """Host address of each page (int64), for copy kernels."""
        pages = np.asarray(pages, dtype=np.int64)
        return self._bases[pages // self.chunk_pages] + (pages % self.chunk_pages) * self.page_bytes

    def close(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._owners.clear()
            self._bases = np.zeros(0, dtype=np.int64)
            self._free.clear()
