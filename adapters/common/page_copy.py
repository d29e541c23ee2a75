"""Copy tables: many (destination, source, size) rows executed as one operation.

A request's KV blocks are scattered over every layer's cache (72 block-planes per block for an
8B model), so moving them one `copy_` at a time costs more in launches than in bytes. A table is
built with numpy and run by one Triton kernel on a GPU (device and pinned host addresses alike:
pinned memory is mapped into the GPU's address space), or by a memmove loop on the host (rows that
continue each other are merged first). Without Triton a GPU table falls back to one copy per row.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Any

import numpy as np

CHUNK_WORDS = 1024  # 8 KiB per loop turn of a program
HOST_PROGRAMS = 32  # programs of a kernel that touches host memory: the link saturates with few SMs


@lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_table_kernel(dst_addrs, src_addrs, sizes, rows, CHUNK: tl.constexpr):
        offsets = tl.arange(0, CHUNK)
        row = tl.program_id(0)
        while row < rows:
            dst = tl.load(dst_addrs + row).to(tl.pointer_type(tl.int64))
            src = tl.load(src_addrs + row).to(tl.pointer_type(tl.int64))
            words = tl.load(sizes + row) // 8
            for start in range(0, words, CHUNK):
                idx = start + offsets
                mask = idx < words
                tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)
            row += tl.num_programs(0)

    return copy_table_kernel


def merge_rows(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge rows whose destination and source both continue the previous row's."""
    if len(dst) < 2:
        return dst, src, sizes
    cont = (dst[1:] == dst[:-1] + sizes[:-1]) & (src[1:] == src[:-1] + sizes[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    merged = np.add.reduceat(sizes, starts)
    return dst[starts], src[starts], merged


def copy_host(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> None:
    """The table on host memory (ctypes.memmove releases the GIL for each row)."""
    move = ctypes.memmove
    for d, s, n in zip(*(a.tolist() for a in merge_rows(dst, src, sizes))):
        move(d, s, n)


@lru_cache(maxsize=None)
def triton_usable(device: int) -> bool:
    """Triton compiles the table kernel and moves a row right on GPU `device` (checked once)."""
    try:
        import torch

        src = torch.arange(4096, dtype=torch.int64, device=f"cuda:{device}")
        dst = torch.zeros_like(src)
        rows = np.array([[dst.data_ptr() + 8 * 1024, src.data_ptr(), 8 * 3072]], dtype=np.int64)
        with torch.cuda.device(device):
            _run_kernel(rows[:, 0], rows[:, 1], rows[:, 2], device, programs=4)
            torch.cuda.synchronize()
        return bool(torch.equal(dst[1024:], src[:3072])) and not bool(dst[:1024].any())
    except Exception:  # noqa: BLE001 - no Triton, or no GPU it can compile for
        return False


def _run_kernel(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, device: int, programs: int) -> None:
    import torch

    # From pinned memory: an upload from pageable memory would make the host wait for the stream.
    table = torch.from_numpy(np.stack([dst, src, sizes]).astype(np.int64, copy=False)).pin_memory()
    table = table.to(f"cuda:{device}", non_blocking=True)
    _kernel()[(max(1, min(programs, len(dst))),)](table[0], table[1], table[2], len(dst), CHUNK=CHUNK_WORDS)


def copy_table(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, device: int | None,
               programs: int = HOST_PROGRAMS) -> None:
    """Run the table: on the host when `device` is None, else on GPU `device`'s current stream
    (asynchronously; record an event after it). Every size and address must be 8-byte aligned on a GPU."""
    dst, src, sizes = (np.ascontiguousarray(a, dtype=np.int64) for a in (dst, src, sizes))
    if not len(dst):
        return
    if device is None:
        copy_host(dst, src, sizes)
        return
    dst, src, sizes = merge_rows(dst, src, sizes)
    if triton_usable(device) and not ((dst | src | sizes) & 7).any():
        _run_kernel(dst, src, sizes, device, programs)
        return
    from pdsdk.connectors.transports.common.buffers import torch_view

    for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist()):  # slow path: one copy per row
        torch_view(d, n, f"cuda:{device}").copy_(torch_view(s, n, f"cuda:{device}"), non_blocking=True)


def dma_copy(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, device: int) -> None:
    """GPU rows `src` into pinned host rows `dst` by the copy engine, one copy per merged run, on the
    current stream (the copy engine beats SMs writing over the link: vLLM measured the same)."""
    import torch

    from pdsdk.connectors.transports.common.buffers import host_array, torch_view

    for d, s, n in zip(*(a.tolist() for a in merge_rows(*(np.asarray(a, np.int64) for a in (dst, src, sizes))))):
        torch.from_numpy(host_array(d, n)).copy_(torch_view(s, n, f"cuda:{device}"), non_blocking=True)
