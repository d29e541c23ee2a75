"""Heterogeneous TP (prefill TP != decode TP) without an engine: which KV heads each decode rank
reads from which prefill rank, the spans that slice pages by head (checked bit-exact by moving the
bytes between fake per-rank KV caches cut from one full cache, for the block layouts vLLM's
backends use), the read notes and the prefill's rule for freeing pages read by several ranks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pdsdk import KVLayout, LayoutMismatch
from pdsdk.adapters.vllm.pages import (
    READ_NOTE, ReadTracker, block_geometry, block_spans, head_geometry, parse_note, read_note)
from pdsdk.kv import (
    HeadGeometry, HeadRead, coalesce, head_plan, head_readers, head_slice_spans, rank_heads)

PAIRS = [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2)]
HEADS = [2, 4, 8]


# --- head intervals ---------------------------------------------------------------------------


def test_rank_heads_is_vllms_split():
    assert [rank_heads(8, 2, r) for r in range(2)] == [(0, 4), (4, 4)]
    assert [rank_heads(4, 4, r) for r in range(4)] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    # More ranks than heads: each head replicated over TP/H consecutive ranks (QKVParallelLinear).
    assert [rank_heads(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match="split evenly"):
        rank_heads(6, 4, 0)
    with pytest.raises(ValueError, match="multiple"):
        rank_heads(4, 6, 0)


@pytest.mark.parametrize("tp_p,tp_d", PAIRS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("kv_split", [True, False])
def test_head_plan_covers_each_decode_rank_exactly(tp_p, tp_d, heads, kv_split):
    h = heads if kv_split else 1
    layers = 4
    read_by = {p: set() for p in range(tp_p)}
    for d in range(tp_d):
        first, n = rank_heads(h, tp_d, d)
        covered = np.zeros((n, layers), dtype=int)
        for r in head_plan(heads, tp_p, tp_d, d, kv_split):
            p_first, p_n = rank_heads(h, tp_p, r.remote_rank)
            # Same global heads on both sides, inside both ranks' ranges.
            assert first + r.local_head == p_first + r.remote_head
            assert 0 <= r.local_head and r.local_head + r.count <= n
            assert 0 <= r.remote_head and r.remote_head + r.count <= p_n
            covered[r.local_head:r.local_head + r.count, r.part::r.parts] += 1
            read_by[r.remote_rank].add(d)
        assert (covered == 1).all(), (d, covered)  # every head of every layer exactly once
    # Every prefill rank is read (so it frees its pages on notes, not at lease expiry), and the
    # reader count it is told matches the decode ranks that read it.
    for p in range(tp_p):
        assert read_by[p], p
        assert head_readers(heads, tp_p, tp_d, p, kv_split) == len(read_by[p])


def test_same_tp_plan_is_the_whole_rank():
    assert head_plan(8, 2, 2, 1) == [HeadRead(1, 0, 0, 4, 0, 1)]
    assert head_plan(8, 2, 1, 0) == [HeadRead(0, 0, 0, 4), HeadRead(1, 4, 0, 4)]
    assert head_plan(8, 1, 2, 1) == [HeadRead(0, 0, 4, 4)]


# --- spans, moved for real between fake KV caches -----------------------------------------------

N, D, BLOCKS, LAYERS = 16, 8, 12, 2


def make_rank_cache(layout: str, local_heads: int):
    """(physical tensor, the tensor vLLM would hand the connector, its logical (P, B, N, H, C) view)."""
    if layout == "nhd":  # flash-attn: (2, blocks, tokens, heads, head_dim)
        base = torch.zeros(2, BLOCKS, N, local_heads, D, dtype=torch.bfloat16)
        return base, base, lambda t: t
    if layout == "hnd":  # flash-attn/flashinfer HND: a permuted view of (2, blocks, heads, tokens, head_dim)
        base = torch.zeros(2, BLOCKS, local_heads, N, D, dtype=torch.bfloat16)
        return base, base.permute(0, 1, 3, 2, 4), lambda t: t
    if layout == "cpu":  # vLLM CPU (LBHNC): (blocks, heads, tokens, K|V) with K and V side by side
        base = torch.zeros(BLOCKS, local_heads, N, 2 * D, dtype=torch.bfloat16)
        return base, base, lambda t: t.permute(0, 2, 1, 3)[None]
    raise AssertionError(layout)


def rank_caches(layout, heads, tp, full=None, remote_ids=None):
    """Per rank, per layer: (bytes as numpy, vLLM tensor, logical view fn). Filled from `full` (per layer,
    logical (P, logical block, N, H, C)) at `remote_ids` when given."""
    ranks = []
    for r in range(tp):
        first, n = rank_heads(heads, tp, r)
        layers = []
        for layer in range(LAYERS):
            base, view, logical = make_rank_cache(layout, n)
            if full is not None:
                lv = logical(view)
                for i, b in enumerate(remote_ids):
                    lv[:, b] = full[layer][:, i, :, first:first + n]
            layers.append((base.view(torch.uint8).reshape(-1).numpy(), view, logical))
        ranks.append(layers)
    return ranks


def move(local_bytes, remote_bytes, local, remote):
    local, remote = coalesce(local, remote)
    for (lr, lo, n), (rr, ro, _) in zip(local.tolist(), remote.tolist()):
        local_bytes[lr][lo:lo + n] = remote_bytes[rr][ro:ro + n]


@pytest.mark.parametrize("layout", ["nhd", "hnd", "cpu"])
@pytest.mark.parametrize("tp_p,tp_d", PAIRS)
@pytest.mark.parametrize("heads", HEADS)
def test_head_slices_move_exactly_the_right_bytes(layout, tp_p, tp_d, heads):
    rng = np.random.default_rng(tp_p * 100 + tp_d * 10 + heads)
    nblocks = 5
    remote_ids, local_ids = rng.permutation(BLOCKS)[:nblocks], rng.permutation(BLOCKS)[:nblocks]
    planes, c = (1, 2 * D) if layout == "cpu" else (2, D)
    full = [torch.randn(planes, nblocks, N, heads, c).to(torch.bfloat16) for _ in range(LAYERS)]
    prefill = rank_caches(layout, heads, tp_p, full, remote_ids)
    decode = rank_caches(layout, heads, tp_d)

    def geometry(rank_layers, tp, r):
        n = rank_heads(heads, tp, r)[1]
        heads_g = [head_geometry(v, BLOCKS, N, n) for _, v, _ in rank_layers]
        assert all(isinstance(g, HeadGeometry) for g in heads_g), heads_g
        return [block_geometry(v, BLOCKS) for _, v, _ in rank_layers], heads_g

    for d in range(tp_d):
        lgeo, lheads = geometry(decode[d], tp_d, d)
        for read in head_plan(heads, tp_p, tp_d, d):
            rgeo, rheads = geometry(prefill[read.remote_rank], tp_p, read.remote_rank)
            local, remote = head_slice_spans(local_ids, lgeo, lheads, remote_ids, rgeo, rheads, read)
            move([b for b, _, _ in decode[d]], [b for b, _, _ in prefill[read.remote_rank]], local, remote)
        first, n = rank_heads(heads, tp_d, d)
        for layer, (_, view, logical) in enumerate(decode[d]):
            got = logical(view)[:, torch.as_tensor(local_ids)]
            want = full[layer][:, :, :, first:first + n]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (d, layer)
        # Blocks the request does not own stay untouched.
        others = sorted(set(range(BLOCKS)) - set(local_ids.tolist()))
        for _, view, logical in decode[d]:
            assert not logical(view)[:, others].any()


def test_span_runs_are_as_long_as_the_layouts_allow():
    """HND both sides: one span per block and plane; NHD: one per token, merged where both sides continue."""
    hnd = HeadGeometry(tokens=16, token_stride=16, head_stride=256, chunk=16)
    nhd1, nhd2 = HeadGeometry(16, 16, 16, 16), HeadGeometry(16, 32, 16, 16)
    geo1, geo2 = [[2, 1 << 20, 256, 256]], [[2, 1 << 20, 512, 512]]
    read = HeadRead(remote_rank=0, local_head=0, remote_head=1, count=1)
    local, remote = head_slice_spans([3], geo1, [hnd], [5], geo2, [HeadGeometry(16, 16, 256, 16)], read)
    assert local.tolist() == [[0, 768, 256], [0, (1 << 20) + 768, 256]]
    assert remote.tolist() == [[0, 5 * 512 + 256, 256], [0, (1 << 20) + 5 * 512 + 256, 256]]
    local, remote = head_slice_spans([3], geo1, [nhd1], [5], geo2, [nhd2], read)
    assert len(local) == 2 * 16 and (local[:, 2] == 16).all()
    assert remote[:2, 1].tolist() == [5 * 512 + 16, 5 * 512 + 48]


def test_head_geometry_refuses_what_it_cannot_tell():
    t = torch.zeros(2, BLOCKS, N, N, D)  # as many heads as tokens per block
    assert "cannot tell heads from tokens" in head_geometry(t, BLOCKS, N, N)
    g = head_geometry(torch.zeros(BLOCKS, 1, N, 2 * D), BLOCKS, N, 1)  # one head per rank: head-major
    assert g.head_major()


@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2), (4, 2), (4, 1)])
def test_mla_reads_whole_blocks_of_a_share_of_the_layers(tp_p, tp_d):
    geo = [[1, 0, 64, 64]] * 4
    every = sorted(map(tuple, block_spans([0, 1], geo).tolist()))
    for d in range(tp_d):
        rows = []
        for read in head_plan(1, tp_p, tp_d, d, kv_split=False):
            spans = block_spans([0, 1], geo)
            rows += spans[spans[:, 0] % read.parts == read.part].tolist()
        assert sorted(map(tuple, rows)) == every  # each decode rank: every layer's blocks exactly once


# --- handshake and release ----------------------------------------------------------------------


def test_layouts_of_another_tp_connect_only_when_both_slice_by_head():
    a = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, page_size=32, tp_size=2, hetero_tp=True)
    b = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, page_size=32, tp_size=1, hetero_tp=True)
    a.check_compatible(b)
    assert a.fingerprint() != b.fingerprint()  # store keys stay per TP shard
    with pytest.raises(LayoutMismatch, match="tp_size"):
        KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, page_size=32, tp_size=1).check_compatible(a)
    for field, value in (("num_kv_heads", 8), ("head_dim", 32), ("page_size", 16), ("num_layers", 3),
                         ("dtype", "float16")):
        other = KVLayout(**{**dict(num_layers=2, num_kv_heads=4, head_dim=64, page_size=32, tp_size=1,
                                   hetero_tp=True), field: value})
        with pytest.raises(LayoutMismatch, match=field):
            a.check_compatible(other)


def test_read_notes():
    assert read_note("cmpl-1|x") == READ_NOTE + b"cmpl-1|x"  # same TP: today's note, unchanged
    assert parse_note(read_note("cmpl-1|x")) == ("cmpl-1|x", 0, 1)
    assert parse_note(read_note("cmpl-1", 3, 4)) == ("cmpl-1", 3, 4)
    assert parse_note(b"something else") is None


@pytest.mark.parametrize("tp_p,tp_d", PAIRS)
@pytest.mark.parametrize("heads", HEADS)
def test_prefill_rank_frees_pages_once_every_reader_read(tp_p, tp_d, heads):
    notes = {p: [] for p in range(tp_p)}
    for d in range(tp_d):
        for r in head_plan(heads, tp_p, tp_d, d):
            notes[r.remote_rank].append(read_note("req", d, head_readers(heads, tp_p, tp_d, r.remote_rank)))
    for p, mine in notes.items():
        for order in itertools.permutations(mine):
            tracker = ReadTracker()
            for i, note in enumerate(order):
                assert "req" not in tracker.read
                tracker.note(note, now=float(i))
                tracker.note(note, now=float(i))  # a repeated note counts once
            assert "req" in tracker.read, (p, order)


def test_read_tracker_forgets_and_expires():
    t = ReadTracker()
    t.note(read_note("a", 0, 2), 0.0)
    t.note(read_note("b"), 0.0)
    assert "b" in t.read and "a" not in t.read
    t.expire(now=100.0, keep_s=10.0)
    t.note(read_note("a", 1, 2), 100.0)  # its first reader's note expired: still waiting
    assert "a" not in t.read and "b" not in t.read
    t.note(read_note("a", 0, 2), 101.0)
    assert "a" in t.read
    t.forget("a")
    assert not t.read


def test_launch_plan_gives_each_role_its_tp_and_gpus():
    from pdsdk import ConfigError
    from pdsdk.launch.plan import LaunchOptions, build_plan

    plan = build_plan(LaunchOptions(engine="vllm", model="m", prefill=1, decode=1, prefill_tp=2,
                                    worker_gpus=[[0, 1], [1]]))
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in plan.workers] == ["0,1", "1"]
    prefill, decode = (w.cmd for w in plan.workers)
    assert prefill[prefill.index("--tensor-parallel-size") + 1] == "2" and "--tensor-parallel-size" not in decode
    with pytest.raises(ConfigError, match="worker_gpus"):
        build_plan(LaunchOptions(engine="vllm", model="m", prefill=1, decode=1, prefill_tp=2, gpus=[0, 1, 2]))
    with pytest.raises(ConfigError, match="worker_gpus"):
        build_plan(LaunchOptions(engine="vllm", model="m", prefill_tp=2, worker_gpus=[[0], [1]]))
