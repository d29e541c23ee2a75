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


def page_spans(region: int, page_ids: Iterable[int], page_bytes: int,
               *, base: int = 0, stride: int | None = None) -> list[Span]:
    """Spans of whole pages `page_ids` in a region holding pages every `stride` bytes from `base`."""
    stride = page_bytes if stride is None else stride
    return [Span(region, base + int(p) * stride, page_bytes) for p in page_ids]


def check_spans(spans: Sequence[Span], regions: Sequence[Region], side: str) -> None:
    """Raise ValueError for an empty or out-of-range span, naming its index and the region size."""
    for i, s in enumerate(spans):
        if s.length <= 0:
            raise ValueError(f"{side} span {i} has length {s.length}; spans must cover at least one byte")
        if not 0 <= s.region < len(regions):
            raise ValueError(f"{side} span {i} names region {s.region}; {len(regions)} region(s) are registered")
        if s.offset < 0 or s.end > regions[s.region].length:
            raise ValueError(f"{side} span {i} [{s.offset}, {s.end}) is outside region {s.region} "
                             f"of {regions[s.region].length} bytes")


def coalesce(local: Sequence[Span], remote: Sequence[Span]) -> tuple[list[Span], list[Span]]:
    """Merge span pairs that continue each other on both sides into runs.

    Pairs are matched by position and must have equal lengths. The result moves exactly the same
    bytes to the same places, ordered by local address, with no two neighbours left mergeable.
    """
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local spans but {len(remote)} remote spans; they pair up one to one")
    pairs = []
    for i, (a, b) in enumerate(zip(local, remote)):
        if a.length != b.length:
            raise ValueError(f"span pair {i}: local length {a.length} != remote length {b.length}")
        if a.length:
            pairs.append((a, b))
    pairs.sort(key=lambda p: (p[0].region, p[0].offset, p[1].region, p[1].offset))
    out_l: list[Span] = []
    out_r: list[Span] = []
    for a, b in pairs:
        if out_l:
            pa, pb = out_l[-1], out_r[-1]
            if (pa.region == a.region and pa.end == a.offset
                    and pb.region == b.region and pb.end == b.offset):
                out_l[-1] = Span(pa.region, pa.offset, pa.length + a.length)
                out_r[-1] = Span(pb.region, pb.offset, pb.length + b.length)
                continue
        out_l.append(a)
        out_r.append(b)
    return out_l, out_r


def total_bytes(spans: Iterable[Span]) -> int:
    return sum(s.length for s in spans)
