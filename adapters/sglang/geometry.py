"""Where SGLang's KV pages live, in pdsdk terms: regions, a layout fingerprint and page spans.

SGLang hands a transfer backend `KVArgs`: one contiguous buffer per KV entry (for MHA: every
layer's K buffer, then every layer's V buffer; for MLA one latent buffer per layer), with
`kv_item_lens` = bytes of one page in that buffer, plus the metadata (aux) buffers with one row per
request slot. pdsdk registers them all, KV first, in SGLang's order, so region i on both sides is
the same buffer. No SGLang import: this runs anywhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdsdk.kv import DTYPE_BYTES, KVLayout, Region

# kv_cache_dtype_str spellings SGLang uses that are not pdsdk dtype names
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32",
                  "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def _ints(values: Any) -> list[int]:
    return [int(v) for v in (values or [])]


def kv_regions(kv_args: Any, device: str = "cpu") -> list[Region]:
    """KV buffers, then aux buffers: the regions a manager registers."""
    kv = [Region(a, n, device) for a, n in zip(_ints(kv_args.kv_data_ptrs), _ints(kv_args.kv_data_lens))]
    aux = [Region(a, n, "cpu") for a, n in zip(_ints(getattr(kv_args, "aux_data_ptrs", [])),
                                                _ints(getattr(kv_args, "aux_data_lens", [])))]
    return kv + aux


def layout_from_kv_args(kv_args: Any, *, tp_size: int, tp_rank: int, is_mla: bool) -> KVLayout:
    """The layout whose fingerprint peers compare at connect.

    MHA with a known dtype and head count gets its real geometry (K/V planes, heads, head_dim).
    Anything else (MLA, fp4/mxfp8 caches, draft entries) is described by its bytes: one "head" of
    `page bytes / page_size` uint8 per token, per buffer; still fails loudly on any difference."""
    page_size = int(kv_args.page_size)
    items = _ints(kv_args.kv_item_lens)
    if not items:
        raise ValueError("KVArgs has no KV buffers (kv_item_lens is empty)")
    dtype = str(getattr(kv_args, "kv_cache_dtype_str", "") or "").removeprefix("torch.")
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    heads = getattr(kv_args, "kv_head_num", None)
    total_heads = getattr(kv_args, "total_kv_head_num", None) or heads
    if (not is_mla and dtype in DTYPE_BYTES and heads and len(items) % 2 == 0 and len(set(items)) == 1
            and items[0] % (page_size * heads * DTYPE_BYTES[dtype]) == 0):
        head_dim = items[0] // (page_size * heads * DTYPE_BYTES[dtype])
        layout = KVLayout(num_layers=len(items) // 2, num_kv_heads=int(total_heads), head_dim=head_dim,
                          page_size=page_size, dtype=dtype, kv_split=True, tp_rank=tp_rank, tp_size=tp_size)
        if layout.kv_heads_per_rank == heads:
            return layout
    # Bytes: the fingerprint covers the buffer count, page size, TP and the first buffer's page bytes;
    # the registration message compares every buffer's page bytes (kv_item_lens) as well.
    return KVLayout(num_layers=len(items), num_kv_heads=tp_size, head_dim=max(1, items[0] // page_size),
                    page_size=page_size, dtype="uint8", kv_split=False, tp_rank=tp_rank, tp_size=tp_size)


def page_rows(first_region: int, item_lens: list[int], pages: np.ndarray) -> np.ndarray:
    """(n, 3) spans (region, offset, length) of `pages` in every buffer `first_region + i`, whose
    pages are `item_lens[i]` bytes each. Vectorized: no per-page Python."""
    pages = np.asarray(pages, dtype=np.int64)
    lens = np.asarray(item_lens, dtype=np.int64)
    out = np.empty((len(lens), len(pages), 3), dtype=np.int64)
    out[:, :, 0] = (first_region + np.arange(len(lens)))[:, None]
    out[:, :, 1] = lens[:, None] * pages[None, :]
    out[:, :, 2] = lens[:, None]
    return out.reshape(-1, 3)


def transfer_spans(src_pages: np.ndarray, dst_pages: np.ndarray, item_lens: list[int],
                   aux: tuple[int, int] | None = None, aux_item_lens: list[int] | None = None,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Local and remote spans moving KV pages `src_pages` -> `dst_pages` in every KV buffer and,
    when `aux` = (src slot, dst slot), that metadata row of every aux buffer. Regions: KV buffers
    first, aux buffers after them (see `kv_regions`); both sides register the same shapes."""
    local = [page_rows(0, item_lens, src_pages)]
    remote = [page_rows(0, item_lens, dst_pages)]
    if aux is not None and aux_item_lens:
        local.append(page_rows(len(item_lens), aux_item_lens, np.array([aux[0]])))
        remote.append(page_rows(len(item_lens), aux_item_lens, np.array([aux[1]])))
    return np.concatenate(local), np.concatenate(remote)
