"""L1: how a KV cache is laid out, and which bytes of it a transfer moves.

`KVLayout` describes one rank's paged KV cache. Peers compare fingerprints at connect, so a
prefill and a decode worker that disagree on page size, dtype, heads, layers or TP fail loudly
instead of moving garbage. `Region`/`Span` address bytes inside registered memory, and
`coalesce` merges adjacent spans into runs: one descriptor per run, not per page.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from pdsdk.errors import ConfigError, LayoutMismatch

DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}
# Fields both peers must agree on for pages to be interchangeable. Device and rank may differ.
FINGERPRINT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "page_size", "dtype", "kv_split", "tp_size")


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's paged KV cache. `num_kv_heads` is the model's total; a rank holds its TP share."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "bfloat16"
    kv_split: bool = True  # K and V in separate pages (MHA/GQA); False: one fused latent (MLA)
    device: str = "cpu"
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"layout.{name}", f"must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError("layout.dtype", f"unknown dtype {self.dtype!r}; valid: {', '.join(DTYPE_BYTES)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError("layout.tp_rank", f"must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_heads_per_rank(self) -> int:
        # With fewer KV heads than ranks, engines replicate heads: every rank holds at least one.
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer of K (or V, or the fused latent) on this rank."""
        return self.page_size * self.kv_heads_per_rank * self.head_dim * self.dtype_bytes

    @property
    def planes(self) -> int:
        """Page planes per layer: K and V, or one fused plane."""
        return 2 if self.kv_split else 1

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies on this rank, over every layer and plane."""
        return self.num_layers * self.planes * self.kv_heads_per_rank * self.head_dim * self.dtype_bytes

    def fingerprint(self) -> str:
        """Stable across processes, machines and Python versions (not `hash()`)."""
        canonical = msgspec.json.encode({f: getattr(self, f) for f in FINGERPRINT_FIELDS}, order="sorted")
        return hashlib.sha256(canonical).hexdigest()[:16]

    def diff(self, other: KVLayout) -> dict[str, tuple[object, object]]:
        return {f: (getattr(self, f), getattr(other, f))
                for f in FINGERPRINT_FIELDS if getattr(self, f) != getattr(other, f)}

    def check_compatible(self, other: KVLayout) -> None:
        """Raise `LayoutMismatch` naming every field on which `other` differs."""
        differences = self.diff(other)
        if differences:
            raise LayoutMismatch(differences)


class Region(msgspec.Struct, frozen=True, array_like=True):
    """A block of memory registered with a transport: host or device address, bytes, device."""

    addr: int
    length: int
    device: str = "cpu"  # "cpu" or "cuda:N"


class Span(msgspec.Struct, frozen=True, array_like=True):
    """`length` bytes at `offset` inside registered region number `region`."""

    region: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


SpanArray = np.ndarray  # int64, shape (n, 3): region, offset, length per row


def span_array(spans: Sequence[Span] | np.ndarray) -> np.ndarray:
    """Spans as an (n, 3) int64 array, the form the hot path works on (no per-span Python)."""
    if isinstance(spans, np.ndarray):
        if spans.ndim != 2 or spans.shape[1] != 3:
            raise ValueError(f"a span array has shape (n, 3) (region, offset, length), got {spans.shape}")
        return spans.astype(np.int64, copy=False)
    if not len(spans):
        return np.zeros((0, 3), dtype=np.int64)
    return np.array([(s.region, s.offset, s.length) for s in spans], dtype=np.int64)


def to_spans(array: np.ndarray) -> list[Span]:
    return [Span(int(r), int(o), int(n)) for r, o, n in array]


def page_spans(region: int, page_ids: Iterable[int], page_bytes: int,
               *, base: int = 0, stride: int | None = None) -> np.ndarray:
    """Spans of whole pages `page_ids` in a region holding pages every `stride` bytes from `base`."""
    ids = np.asarray(list(page_ids) if not isinstance(page_ids, np.ndarray) else page_ids, dtype=np.int64)
    out = np.empty((len(ids), 3), dtype=np.int64)
    out[:, 0] = region
    out[:, 1] = base + ids * (page_bytes if stride is None else stride)
    out[:, 2] = page_bytes
    return out


def check_spans(spans: Sequence[Span] | np.ndarray, regions: Sequence[Region], side: str) -> np.ndarray:
    """The spans as an array; ValueError for an empty or out-of-range span, naming the first bad one."""
    arr = span_array(spans)
    if not len(arr):
        return arr
    sizes = np.array([r.length for r in regions], dtype=np.int64)
    region, offset, length = arr[:, 0], arr[:, 1], arr[:, 2]
    # Fast path first (this runs on every transfer): bounds by min/max, details only on failure.
    if (len(regions) and region.min() >= 0 and region.max() < len(regions) and length.min() > 0
            and offset.min() >= 0 and ((offset + length) <= sizes[region]).all()):
        return arr
    for i, (r, o, n) in enumerate(arr.tolist()):
        if n <= 0:
            raise ValueError(f"{side} span {i} has length {n}; spans must cover at least one byte")
        if not 0 <= r < len(regions):
            raise ValueError(f"{side} span {i} names region {r}; {len(regions)} region(s) are registered")
        if o < 0 or o + n > regions[r].length:
            raise ValueError(f"{side} span {i} [{o}, {o + n}) is outside region {r} of {regions[r].length} bytes")
    raise AssertionError("unreachable")


def coalesce(local: Sequence[Span] | np.ndarray, remote: Sequence[Span] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge span pairs that continue each other on both sides into runs.

    Pairs are matched by position and must have equal lengths. The result moves exactly the same
    bytes to the same places, ordered by local address, with no two neighbours left mergeable.
    Vectorized: thousands of pages coalesce in well under a millisecond.
    """
    a, b = span_array(local), span_array(remote)
    if len(a) != len(b):
        raise ValueError(f"{len(a)} local spans but {len(b)} remote spans; they pair up one to one")
    unequal = np.flatnonzero(a[:, 2] != b[:, 2])
    if len(unequal):
        i = int(unequal[0])
        raise ValueError(f"span pair {i}: local length {a[i, 2]} != remote length {b[i, 2]}")
    if len(a) == 1 and a[0, 2] > 0:  # the common single-run transfer: nothing to merge
        return a, b
    keep = a[:, 2] > 0
    a, b = a[keep], b[keep]
    if not len(a):
        return a, b
    # One int64 sort key (region << 44 | offset): much faster than a 4-key lexsort. Regions of up to
    # 16 TiB; equal keys (overlapping local spans) keep their order and are simply not merged.
    order = np.argsort((a[:, 0] << 44) | a[:, 1], kind="stable")
    a, b = a[order], b[order]
    continues = ((a[1:, 0] == a[:-1, 0]) & (a[1:, 1] == a[:-1, 1] + a[:-1, 2])
                 & (b[1:, 0] == b[:-1, 0]) & (b[1:, 1] == b[:-1, 1] + b[:-1, 2]))
    starts = np.concatenate(([0], np.flatnonzero(~continues) + 1))
    lengths = np.add.reduceat(a[:, 2], starts)
    a, b = a[starts], b[starts]
    a[:, 2] = b[:, 2] = lengths
    return a, b


def split_spans(local: np.ndarray, remote: np.ndarray, max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut span pairs longer than `max_bytes` into pieces of at most `max_bytes`."""
    pieces = -(-local[:, 2] // max_bytes)
    if (pieces <= 1).all():
        return local, remote
    rows = np.repeat(np.arange(len(local)), pieces)
    first = np.concatenate(([0], np.cumsum(pieces)[:-1]))
    k = np.arange(len(rows)) - np.repeat(first, pieces)  # piece number within its span
    lengths = np.minimum(max_bytes, local[rows, 2] - k * max_bytes)
    out = []
    for side in (local, remote):
        s = side[rows].copy()
        s[:, 1] += k * max_bytes
        s[:, 2] = lengths
        out.append(s)
    return out[0], out[1]


def span_addresses(spans: np.ndarray, regions: Sequence[Region]) -> np.ndarray:
    """Absolute start address of every span."""
    bases = np.array([r.addr for r in regions], dtype=np.uint64)
    return bases[spans[:, 0]] + spans[:, 1].astype(np.uint64)


def total_bytes(spans: Sequence[Span] | np.ndarray) -> int:
    return int(span_array(spans)[:, 2].sum())
