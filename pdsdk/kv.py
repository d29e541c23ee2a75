"""L1: how a KV cache is laid out, and which bytes of it a transfer moves.

`KVLayout` describes one rank's paged KV cache. Peers compare fingerprints at connect, so a
prefill and a decode worker that disagree on page size, dtype, heads, layers or TP fail loudly
instead of moving garbage. `Region`/`Span` address bytes inside registered memory, and
`coalesce` merges adjacent spans into runs: one descriptor per run, not per page.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

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
    # This side slices pages by KV head (heterogeneous TP): a peer of another TP size is compatible
    # when both sides say so (every other field must still match). Not part of the fingerprint.
    hetero_tp: bool = False

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
        """Raise `LayoutMismatch` naming every field on which `other` differs. With `hetero_tp` on
        both sides, `tp_size` may differ (the pages are sliced by KV head, see `head_plan`)."""
        differences = self.diff(other)
        if self.hetero_tp and other.hetero_tp:
            differences.pop("tp_size", None)
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
    """The spans as an array; ValueError for an empty or out-of-range span, naming the first bad one,
    and for spans over regions of more than one device."""
    arr = span_array(spans)
    if not len(arr):
        return arr
    sizes = np.array([r.length for r in regions], dtype=np.int64)
    region, offset, length = arr[:, 0], arr[:, 1], arr[:, 2]
    # Fast path first (this runs on every transfer): bounds by min/max, details only on failure.
    if (len(regions) and region.min() >= 0 and region.max() < len(regions) and length.min() > 0
            and offset.min() >= 0 and ((offset + length) <= sizes[region]).all()):
        _one_device(region, regions, side)
        return arr
    for i, (r, o, n) in enumerate(arr.tolist()):
        if n <= 0:
            raise ValueError(f"{side} span {i} has length {n}; spans must cover at least one byte")
        if not 0 <= r < len(regions):
            raise ValueError(f"{side} span {i} names region {r}; {len(regions)} region(s) are registered")
        if o < 0 or o + n > regions[r].length:
            raise ValueError(f"{side} span {i} [{o}, {o + n}) is outside region {r} of {regions[r].length} bytes")
    raise AssertionError("unreachable")


def check_pages(page_ids: Any, regions: Sequence[Region], region: int, page_bytes: int, side: str) -> np.ndarray:
    """Page ids of `region` as an int64 array; ValueError naming the side for an unknown region or an id
    outside it."""
    ids = np.asarray(page_ids, dtype=np.int64)
    if not 0 <= region < len(regions):
        raise ValueError(f"{side} region {region}; {len(regions)} region(s) are registered")
    pages = regions[region].length // page_bytes
    if len(ids) and (ids.min() < 0 or ids.max() >= pages):
        raise ValueError(f"{side} page ids must be in [0, {pages}) for region {region} "
                         f"({regions[region].length} bytes / {page_bytes}-byte pages)")
    return ids


def _one_device(region: np.ndarray, regions: Sequence[Region], side: str) -> None:
    """One call moves one device's memory per side (host, or one GPU): backends cannot mix them in
    one transfer, so a mixed batch is refused here, by name, not by each backend its own way."""
    first = regions[int(region[0])].device
    if any(r.device != first for r in regions):  # only then look at the spans
        used = sorted({regions[i].device for i in np.unique(region).tolist()})
        if len(used) > 1:
            raise ValueError(f"{side} spans cover memory on {' and '.join(used)}; one transfer moves one "
                             "device's memory per side: post one transfer per device")


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


# --- heterogeneous TP: which KV heads a rank holds, and which bytes of a page hold them ---------


def rank_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first, count) of the model's KV heads that TP rank `tp_rank` holds, vLLM's split
    (QKVParallelLinear): H/TP heads each when TP <= H; with more ranks than heads every rank holds
    one head, replicated over TP/H consecutive ranks. ValueError when neither divides the other."""
    h, tp = num_kv_heads, tp_size
    if not 0 <= tp_rank < tp:
        raise ValueError(f"TP rank {tp_rank} outside [0, {tp})")
    if tp <= h:
        if h % tp:
            raise ValueError(f"{h} KV heads do not split evenly over TP={tp}")
        return tp_rank * (h // tp), h // tp
    if tp % h:
        raise ValueError(f"TP={tp} is not a multiple of the {h} KV heads (vLLM replicates heads only then)")
    return tp_rank // (tp // h), 1


class HeadRead(msgspec.Struct, frozen=True, array_like=True):
    """One read of a decode rank from one prefill rank: `count` heads, from local head offset
    `local_head` (in the decode rank's pages) and remote head offset `remote_head` (in the prefill
    rank's pages), of the layers `l` with `l % parts == part` (replicas of the same heads share the work)."""

    remote_rank: int
    local_head: int
    remote_head: int
    count: int
    part: int = 0
    parts: int = 1


def head_plan(num_kv_heads: int, remote_tp: int, local_tp: int, local_rank: int,
              kv_split: bool = True) -> list[HeadRead]:
    """The reads that give local rank `local_rank` (of `local_tp`) its KV heads from ranks of
    `remote_tp` holding the same model's cache. MLA (`kv_split` False): the latent is replicated on
    every rank, so it is one "head" held by all. Where several remote ranks hold the same heads
    (replicas), the local ranks that need them spread over the replicas so that each replica is read:
    a local rank with several replicas to itself splits the layers among them."""
    h = num_kv_heads if kv_split else 1
    mine_first, mine_n = rank_heads(h, local_tp, local_rank)
    groups: dict[tuple[int, int], list[int]] = {}  # remote (first, count) -> replicas
    for p in range(remote_tp):
        groups.setdefault(rank_heads(h, remote_tp, p), []).append(p)
    local = [rank_heads(h, local_tp, d) for d in range(local_tp)]
    plan = []
    for (first, n), replicas in sorted(groups.items()):
        lo, hi = max(first, mine_first), min(first + n, mine_first + mine_n)
        if lo >= hi:
            continue
        readers = [d for d, (f, c) in enumerate(local) if max(first, f) < min(first + n, f + c)]
        i = readers.index(local_rank)
        if len(replicas) >= len(readers):
            chosen = replicas[i::len(readers)]
        else:
            chosen = [replicas[i % len(replicas)]]
        for part, p in enumerate(chosen):
            plan.append(HeadRead(p, lo - mine_first, lo - first, hi - lo, part, len(chosen)))
    return plan


def head_readers(num_kv_heads: int, remote_tp: int, local_tp: int, remote_rank: int, kv_split: bool = True) -> int:
    """How many local ranks read remote rank `remote_rank` (what it waits for before freeing pages)."""
    return sum(any(r.remote_rank == remote_rank for r in head_plan(num_kv_heads, remote_tp, local_tp, d, kv_split))
               for d in range(local_tp))


class HeadGeometry(msgspec.Struct, frozen=True, array_like=True):
    """Where the KV heads sit inside one block of one layer (bytes): `tokens` token slots each
    `token_stride` apart, heads `head_stride` apart, `chunk` contiguous bytes per (token, head)
    (head_dim elements, or K and V of one head when the backend keeps them side by side).
    NHD (token-major): head_stride == chunk; HND (head-major): token_stride == chunk."""

    tokens: int
    token_stride: int
    head_stride: int
    chunk: int

    def head_major(self) -> bool:
        """Heads [o, o+c) of a block are one run of c * tokens * chunk bytes."""
        return self.token_stride == self.chunk and self.head_stride == self.tokens * self.chunk

    def token_runs(self, count: int) -> bool:
        """Heads [o, o+c) of one token are one run of c * chunk bytes."""
        return count == 1 or self.head_stride == self.chunk


def _slice_offsets(g: HeadGeometry, head: int, count: int, level: int) -> tuple[np.ndarray, int]:
    """Offsets inside a block, and the run length, of heads [head, head+count) at the given level:
    0 one run per block, 1 one run per token, 2 one run per (token, head); order (token, head)."""
    if level == 0:
        return np.array([head * g.head_stride], dtype=np.int64), count * g.tokens * g.chunk
    t = np.arange(g.tokens, dtype=np.int64) * g.token_stride + head * g.head_stride
    if level == 1:
        return t, count * g.chunk
    return (t[:, None] + np.arange(count, dtype=np.int64)[None, :] * g.head_stride).ravel(), g.chunk


def head_slice_spans(local_ids: Sequence[int], local_geometry: Sequence[Sequence[int]],
                     local_heads: Sequence[HeadGeometry | Sequence[int]], remote_ids: Sequence[int],
                     remote_geometry: Sequence[Sequence[int]], remote_heads: Sequence[HeadGeometry | Sequence[int]],
                     read: HeadRead) -> tuple[np.ndarray, np.ndarray]:
    """Paired (local, remote) spans that move `read.count` KV heads of the given blocks in the layers
    of `read`'s part, between two ranks whose pages hold different head ranges. Geometry per layer is
    [planes, plane_stride, block_stride, block_bytes] (as vLLM's adapter derives it); the span's region
    is the layer. Runs are as long as both sides' layouts allow (a block, a token, or a head of a token);
    `coalesce` merges what continues on both sides. Vectorized per layer."""
    li, ri = np.asarray(local_ids, dtype=np.int64), np.asarray(remote_ids, dtype=np.int64)
    if len(li) != len(ri):
        raise ValueError(f"{len(li)} local blocks for {len(ri)} remote ones")
    if len(local_geometry) != len(remote_geometry):
        raise ValueError(f"{len(local_geometry)} local KV layers, {len(remote_geometry)} remote")
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    for layer in range(read.part, len(local_geometry), read.parts):
        (lp, lps, lbs, _), (rp, rps, rbs, _) = local_geometry[layer], remote_geometry[layer]
        lg, rg = (g if isinstance(g, HeadGeometry) else HeadGeometry(*g)
                  for g in (local_heads[layer], remote_heads[layer]))
        if lp != rp or lg.tokens != rg.tokens or lg.chunk != rg.chunk:
            raise ValueError(f"layer {layer}: block layouts differ (planes {lp}/{rp}, tokens {lg.tokens}/"
                             f"{rg.tokens}, bytes per token and head {lg.chunk}/{rg.chunk})")
        level = 0 if lg.head_major() and rg.head_major() else (
            1 if lg.token_runs(read.count) and rg.token_runs(read.count) else 2)
        spans = []
        for ids, planes, ps, bs, g, head in ((li, lp, lps, lbs, lg, read.local_head),
                                             (ri, rp, rps, rbs, rg, read.remote_head)):
            inner, length = _slice_offsets(g, head, read.count, level)
            base = (np.arange(planes, dtype=np.int64)[:, None] * ps + ids[None, :] * bs)  # (plane, block)
            offsets = (base[:, :, None] + inner[None, None, :]).ravel()
            s = np.empty((len(offsets), 3), dtype=np.int64)
            s[:, 0], s[:, 1], s[:, 2] = layer, offsets, length
            spans.append(s)
        parts.append((spans[0], spans[1]))
    if not parts:
        empty = np.zeros((0, 3), dtype=np.int64)
        return empty, empty
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
