"""Contiguous copies of scattered spans and pages: numpy on the host, one index kernel per region on a GPU.

The staged path (staging.py), `nccl` (contiguous tensors for send/recv) and `local` (GPU pages) use them.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def common_page(*span_arrays: np.ndarray) -> int | None:
    """The largest page size every offset and length is a multiple of (their gcd), if >= 512 bytes."""
    g = int(np.gcd.reduce(np.concatenate([np.concatenate((a[:, 1], a[:, 2])) for a in span_arrays])))
    return g if g >= 512 else None


def page_indices(offsets: np.ndarray, lengths: np.ndarray, page: int) -> np.ndarray:
    """Index of every page covered by runs (offset, length), in order."""
    counts = lengths // page
    first = offsets // page - np.concatenate(([0], np.cumsum(counts)[:-1]))
    return np.repeat(first, counts) + np.arange(int(counts.sum()))


def copy_pages(dst: Any, dst_idx: np.ndarray, src: Any, src_idx: np.ndarray) -> None:
    """dst[dst_idx] = src[src_idx] over page-shaped views: numpy arrays or (CUDA) tensors."""
    if isinstance(dst, np.ndarray):
        dst[dst_idx] = src[src_idx]
        return
    import torch

    # Widest element that divides the page: index kernels move 8-byte words much faster than bytes.
    width = next(w for w in (8, 4, 2, 1) if dst.shape[1] % w == 0)
    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]
    dst, src = dst.view(dtype), src.view(dtype)
    d = torch.from_numpy(dst_idx).to(dst.device, non_blocking=True)
    s = torch.from_numpy(src_idx).to(src.device, non_blocking=True)
    dst.index_copy_(0, d, src.index_select(0, s))


def pack_spans(region_views: Any, spans: np.ndarray, flat: Any, unpack: bool = False) -> None:
    """Copy spans, in order, into the contiguous 1-D `flat` (numpy or torch, host or GPU), or back out
    of it (`unpack`). `region_views[i]` is a flat uint8 view of region i.

    On a GPU, many equal pages take one indexed copy per region. On a host, index kernels are slower
    than plain copies (4608 x 32 KiB: torch index 230 ms, numpy fancy index 119 ms, torch.cat of the
    views 59 ms, memcpy of the same bytes 43 ms), so there it is one concatenation of span views."""
    on_gpu = not isinstance(flat, np.ndarray) and flat.is_cuda
    page = common_page(spans) if on_gpu else None
    if page is not None and len(flat) % page == 0 and all(len(region_views[int(r)]) % page == 0
                                                          for r in np.unique(spans[:, 0])):
        starts = np.concatenate(([0], np.cumsum(spans[:, 2])[:-1]))
        stage = flat.reshape(-1, page)
        for region in np.unique(spans[:, 0]):
            rows = np.flatnonzero(spans[:, 0] == region)
            pages = region_views[int(region)].reshape(-1, page)
            region_idx = page_indices(spans[rows, 1], spans[rows, 2], page)
            stage_idx = page_indices(starts[rows], spans[rows, 2], page)
            if unpack:
                copy_pages(pages, region_idx, stage, stage_idx)
            else:
                copy_pages(stage, stage_idx, pages, region_idx)
        return
    views = [region_views[r][o:o + n] for r, o, n in spans.tolist()]
    total = int(spans[:, 2].sum())
    if isinstance(flat, np.ndarray):
        if unpack:
            offset = 0
            for v in views:
                v[:] = flat[offset:offset + len(v)]
                offset += len(v)
        else:
            np.concatenate(views, out=flat[:total])
        return
    import torch

    if unpack:
        torch._foreach_copy_(views, list(flat[:total].split(spans[:, 2].tolist())))
    else:
        torch.cat(views, out=flat[:total])
