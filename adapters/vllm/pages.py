"""Where PdsdkConnector's pages sit in vLLM's KV cache tensors (blocks, planes and, for
heterogeneous TP, KV heads), the read notes that say how many decode ranks read a prefill rank,
and the prefill's rule for freeing pages.

No vLLM import here (unit-tested without an engine); the head math and span building are in
pdsdk.kv (`rank_heads`, `head_plan`, `head_slice_spans`).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from pdsdk.kv import HeadGeometry

READ_NOTE = b"pdsdk-read:"
_READER = re.compile(rb"\|(\d+)/(\d+)$")


def block_geometry(tensor: Any, num_blocks: int) -> list[int]:
    """[planes, plane_stride, block_stride, block_bytes] of one layer's KV cache tensor, from its strides:
    a block is every element inside the block dimension's stride (whatever order the backend keeps
    them in); dimensions with a larger stride are planes (K and V kept apart)."""
    el = tensor.element_size()
    shape, strides = tuple(tensor.shape), tensor.stride()
    dims = [d for d in range(len(shape)) if shape[d] == num_blocks]
    if not dims:
        raise ValueError(f"pdsdk: no dimension of {num_blocks} blocks in a KV cache tensor of shape {shape}")
    b = dims[0]
    outer = [d for d in range(len(shape)) if d != b and strides[d] > strides[b]]
    inner = math.prod(shape[d] for d in range(len(shape)) if d != b and d not in outer)
    if inner != strides[b] or len(outer) > 1 or (outer and strides[outer[0]] != num_blocks * strides[b]):
        raise ValueError(f"pdsdk: KV cache tensor of shape {shape} and strides {strides}: blocks are not dense "
                         "in memory; this attention backend's layout is not supported yet")
    planes = shape[outer[0]] if outer else 1
    return [planes, strides[outer[0]] * el if outer else 0, strides[b] * el, inner * el]


def region_bytes(tensor: Any) -> int:
    """Bytes of memory a (possibly permuted, but dense) KV cache tensor spans."""
    return tensor.numel() * tensor.element_size()


def block_spans(block_ids: list[int], geometry: list[list[int]]) -> np.ndarray:
    """Spans (layer region, offset, length) of the given blocks in every layer and plane."""
    ids = np.asarray(block_ids, dtype=np.int64)
    parts = []
    for layer, (planes, plane_stride, block_stride, block_bytes) in enumerate(geometry):
        for plane in range(planes):
            part = np.empty((len(ids), 3), dtype=np.int64)
            part[:, 0], part[:, 1], part[:, 2] = layer, plane * plane_stride + ids * block_stride, block_bytes
            parts.append(part)
    return np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.int64)


def head_geometry(tensor: Any, num_blocks: int, block_size: int, local_heads: int) -> HeadGeometry | str:
    """Where heads and tokens sit inside one block of a layer's KV cache tensor (from its shape and
    strides, whatever order the backend keeps them in), or a string saying why it cannot tell.

    The block dimension has `num_blocks` entries and the planes (K|V kept apart) a larger stride; of
    the dimensions inside a block, the densest one (stride 1) is the per-head content (head_dim, or K
    and V side by side), the one of `block_size` entries the tokens, the one of `local_heads` the heads."""
    el = tensor.element_size()
    shape, strides = tuple(tensor.shape), tensor.stride()
    blocks = [d for d in range(len(shape)) if shape[d] == num_blocks]
    if not blocks:
        return f"no dimension of {num_blocks} blocks in shape {shape}"
    b = blocks[0]
    inner = [d for d in range(len(shape)) if d != b and strides[d] < strides[b] and shape[d] > 1]
    if not inner:
        return f"no block interior in shape {shape}"
    content = min(inner, key=lambda d: strides[d])
    if strides[content] != 1:
        return f"the innermost dimension of shape {shape} (strides {strides}) is not dense"
    rest = [d for d in inner if d != content]
    chunk = shape[content] * el
    if local_heads == 1:
        tok = [d for d in rest if shape[d] == block_size]
        if len(rest) != 1 or len(tok) != 1:
            return f"cannot tell the token dimension in shape {shape} (block size {block_size}, 1 head)"
        token_stride = strides[tok[0]] * el
        # One head: its stride never applies; call it head-major when the tokens are dense.
        head_stride = block_size * chunk if token_stride == chunk else chunk
        return HeadGeometry(block_size, token_stride, head_stride, chunk)
    if local_heads == block_size:
        return (f"{local_heads} KV heads per rank and block size {block_size}: cannot tell heads from tokens "
                f"in shape {shape}")
    tok = [d for d in rest if shape[d] == block_size]
    heads = [d for d in rest if shape[d] == local_heads]
    if len(rest) != 2 or len(tok) != 1 or len(heads) != 1:
        return (f"shape {shape} (strides {strides}): expected one dimension of {block_size} tokens and one of "
                f"{local_heads} heads inside a block")
    g = HeadGeometry(block_size, strides[tok[0]] * el, strides[heads[0]] * el, chunk)
    if math.prod(shape[d] for d in inner) * el > strides[b] * el:
        return f"shape {shape} (strides {strides}): a block's interior is not dense"
    return g


def read_note(remote_request_id: str, reader: int | None = None, readers: int = 1) -> bytes:
    """The notification a decode rank attaches to its read: the request, and, when several decode
    ranks read this prefill rank (heterogeneous TP), which one this is and how many there are.
    One reader: exactly the same-TP note (READ_NOTE + request id)."""
    note = READ_NOTE + remote_request_id.encode()
    if readers > 1:
        note += b"|%d/%d" % (reader or 0, readers)
    return note


def parse_note(note: bytes) -> tuple[str, int, int] | None:
    """(request id, reader, readers) of a read note; None for any other notification."""
    if not note.startswith(READ_NOTE):
        return None
    body = note[len(READ_NOTE):]
    m = _READER.search(body)
    if m is None:
        return body.decode(), 0, 1
    return body[:m.start()].decode(), int(m.group(1)), int(m.group(2))


class ReadTracker:
    """Prefill side: which requests every expected decode reader has read. A request with one reader
    (same TP) is read on its first note; with several, once each reader index has reported."""

    def __init__(self) -> None:
        self.read: dict[str, float] = {}  # request -> when its last expected reader read it
        self._partial: dict[str, tuple[set[int], int, float]] = {}  # request -> (readers seen, expected, first)

    def note(self, note: bytes, now: float) -> None:
        parsed = parse_note(note)
        if parsed is None:
            return
        request_id, reader, readers = parsed
        if readers <= 1:
            self.read[request_id] = now
            return
        seen, _, first = self._partial.get(request_id, (set(), readers, now))
        seen.add(reader)
        if len(seen) >= readers:
            self._partial.pop(request_id, None)
            self.read[request_id] = now
        else:
            self._partial[request_id] = (seen, readers, first)

    def forget(self, request_id: str) -> None:
        self.read.pop(request_id, None)
        self._partial.pop(request_id, None)

    def expire(self, now: float, keep_s: float) -> None:
        """Drop records older than `keep_s` (notes for requests this rank never held, or gave up on)."""
        self.read = {r: t for r, t in self.read.items() if now - t < keep_s}
        self._partial = {r: v for r, v in self._partial.items() if now - v[2] < keep_s}
