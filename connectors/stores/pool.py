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
        self._lock = threading.Lock()

    @property
    def allocated(self) -> int:
        """Pages backed by memory now (in use or free)."""
        return sum(len(c) for c in self._chunks)

    @property
    def free_pages(self) -> int:
        return len(self._free) + max(0, self.capacity - self.allocated)

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` page ids, or None when the pool cannot hold `n` more pages."""
        with self._lock:
            while len(self._free) < n and self.allocated < self.capacity:
                self._grow()
            if len(self._free) < n:
                return None
            taken = self._free[-n:] if n else []
            del self._free[len(self._free) - n:]
        return np.asarray(taken, dtype=np.int64)

    def free(self, pages: Any) -> None:
        with self._lock:
            self._free.extend(int(p) for p in pages)

    def _grow(self) -> None:
        pages = min(self.chunk_pages, self.capacity - self.allocated)  # the last chunk may be shorter
        nbytes = pages * self.page_bytes
        if self.pinned:
            import torch

            owner = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            raw = owner.numpy()
        else:
            owner = np.empty(nbytes + ALIGN, dtype=np.uint8)
            start = (-owner.ctypes.data) % ALIGN  # page-aligned: faster copies
            raw = owner[start:start + nbytes]
        first = len(self._chunks) * self.chunk_pages
        self._owners.append(owner)
        self._chunks.append(raw.reshape(pages, self.page_bytes))
        self._bases = np.append(self._bases, raw.ctypes.data)
        # Lowest ids on top of the stack: a fresh pool hands out consecutive pages (long copy runs).
        self._free.extend(range(first + pages - 1, first - 1, -1))

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
