"""One-pass page gather/scatter on a GPU: `dst[dst_idx] = src[src_idx]` for page-shaped tensors.

torch's `index_copy_(index_select(...))` moves every byte twice (into a temporary, then into
place); across GPUs the first pass crosses NVLink and the second is a full extra pass over the
pages in HBM. One Triton program per (page, 8 KiB chunk) reads the source page once and writes it
in place. The `local` transport's option `gpu_kernel` (default `auto`) takes it wherever Triton is
usable and falls back to torch's pair otherwise. Measured on one H200 (two processes, 4608 pages of
32 KiB, tests/gpu/tier.sh local): 0.28 ms against 0.42 ms for the torch pair, bytes verified.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

BLOCK_WORDS = 1024  # 8 KiB of int64 per program: a 32 KiB page is four programs


@lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_pages_kernel(dst_ptr, src_ptr, dst_idx_ptr, src_idx_ptr, words_per_page, BLOCK: tl.constexpr):
        page = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < words_per_page
        d = tl.load(dst_idx_ptr + page).to(tl.int64)
        s = tl.load(src_idx_ptr + page).to(tl.int64)
        words = tl.load(src_ptr + s * words_per_page + offs, mask=mask)
        tl.store(dst_ptr + d * words_per_page + offs, words, mask=mask)

    return copy_pages_kernel


@lru_cache(maxsize=None)
def triton_works(device: int) -> bool:
    """Triton imports, compiles and moves two pages right on GPU `device` (checked once per device,
    so a missing compiler or an unsupported GPU means torch's pair, not failed transfers)."""
    try:
        import torch

        src = torch.randint(0, 256, (2, 4096), dtype=torch.uint8, device=f"cuda:{device}")
        dst = torch.zeros_like(src)
        with torch.cuda.device(device):
            copy_pages_triton(dst, np.array([1, 0]), src, np.array([0, 1]))
            torch.cuda.synchronize()
        return bool(torch.equal(dst, src.flip(0)))
    except Exception:  # noqa: BLE001 - no Triton, or no GPU it can compile for
        return False


def copy_pages_triton(dst: Any, dst_idx: np.ndarray, src: Any, src_idx: np.ndarray) -> None:
    """As packing.copy_pages for CUDA tensors of shape (pages, page_bytes), on the current stream."""
    import torch

    page_bytes = dst.shape[1]
    if page_bytes % 8 or src.shape[1] != page_bytes:
        from pdsdk.connectors.transports.common.packing import copy_pages

        return copy_pages(dst, dst_idx, src, src_idx)
    words = page_bytes // 8
    # One upload for both index arrays (each host->device copy of pageable memory costs ~10-20 us).
    idx = torch.from_numpy(np.stack([np.asarray(dst_idx, np.int64), np.asarray(src_idx, np.int64)]))
    idx = idx.to(dst.device, non_blocking=True)
    grid = (len(dst_idx), -(-words // BLOCK_WORDS))
    _kernel()[grid](dst.view(torch.int64), src.view(torch.int64), idx[0], idx[1], words, BLOCK=BLOCK_WORDS)
