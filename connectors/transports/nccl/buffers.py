"""Contiguous tensors over span lists: torch.distributed's send/recv move contiguous tensors only."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np
import torch

from pdsdk.connectors.transports.common.buffers import torch_view
from pdsdk.connectors.transports.common.packing import pack_spans
from pdsdk.kv import Region


class SpanTensors:
    """This side's registered regions as tensors; spans that are one run are sent as they lie, others
    are packed into (to send) or unpacked from (once received) a pooled staging buffer."""

    def __init__(self, staging_bytes: int):
        self._views: list[Any] = []  # one uint8 tensor over each registered region
        self._pack_views: list[Any] = []  # the same, as numpy arrays on host (packs twice as fast there)
        self._devices: list[str] = []
        self.pool = StagingPool(staging_bytes)

    def add(self, regions: list[Region]) -> None:
        views = [torch_view(r.addr, r.length, r.device) for r in regions]
        self._views.extend(views)
        self._pack_views.extend(v if v.is_cuda else v.numpy() for v in views)
        self._devices.extend(r.device for r in regions)

    def contiguous(self, spans: np.ndarray) -> tuple[Any, Any]:
        """One contiguous tensor for the spans, and the staging buffer behind it (None for one run)."""
        if len(spans) == 1:
            r, o, n = spans[0].tolist()
            return self._views[r][o:o + n], None
        nbytes = int(spans[:, 2].sum())
        staging = self.pool.get(nbytes, self._devices[int(spans[0, 0])])
        return staging[:nbytes], staging

    @staticmethod
    def parts(spans: np.ndarray, bounds: list[int], buf: Any) -> list[tuple[np.ndarray, Any]]:
        """(spans, slice of buf) of every chunk."""
        ends = np.concatenate(([0], np.cumsum(spans[:, 2]))).tolist()
        return [(spans[a:b], buf[ends[a]:ends[b]]) for a, b in itertools.pairwise(bounds)]

    def pack(self, spans: np.ndarray, part: Any, out: bool = False) -> None:
        """Gather spans into part, or (out) scatter part back to the spans."""
        pack_spans(self._pack_views, spans, part if part.is_cuda else part.numpy(), unpack=out)
        if out and part.is_cuda:
            torch.cuda.current_stream(part.device).synchronize()  # "done" means the bytes are in place


class StagingPool:
    """Free contiguous buffers kept for reuse: first-touching fresh memory costs more than the copy."""

    def __init__(self, limit: int):
        self._free: list[tuple[str, Any]] = []
        self._limit = limit
        self._lock = threading.Lock()

    def get(self, nbytes: int, device: str) -> Any:
        with self._lock:
            fits = [i for i, (d, b) in enumerate(self._free) if d == device and b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i][1].numel()))[1]
        return torch.empty(-(-nbytes // (1 << 20)) << 20, dtype=torch.uint8, device=device)

    def put(self, buf: Any) -> None:
        if buf is None:
            return
        with self._lock:
            if sum(b.numel() for _, b in self._free) + buf.numel() <= self._limit:
                self._free.append((str(buf.device), buf))

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
