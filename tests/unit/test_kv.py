import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdsdk import ConfigError, KVLayout, LayoutMismatch, Region, Span
import numpy as np

from pdsdk.kv import check_spans, coalesce, page_spans, span_array, split_spans, to_spans, total_bytes

layouts = st.builds(
    KVLayout, num_layers=st.integers(1, 96), num_kv_heads=st.integers(1, 64), head_dim=st.sampled_from([32, 64, 128]),
    page_size=st.sampled_from([16, 32, 64]), dtype=st.sampled_from(["bfloat16", "float16", "float8_e4m3fn"]),
    kv_split=st.booleans(), tp_size=st.sampled_from([1, 2, 4]),
)


@given(layouts)
def test_fingerprint_is_stable_and_ignores_device_and_rank(layout):
    import msgspec

    same = msgspec.structs.replace(layout, device="cuda:1", tp_rank=layout.tp_size - 1)
    assert layout.fingerprint() == same.fingerprint()
    assert len(layout.fingerprint()) == 16
    assert layout.diff(same) == {}


@given(layouts, st.sampled_from(["num_layers", "num_kv_heads", "head_dim", "page_size", "tp_size"]))
def test_fingerprint_changes_with_every_shape_field(layout, field):
    import msgspec

    other = msgspec.structs.replace(layout, **{field: getattr(layout, field) * 2})
    assert layout.fingerprint() != other.fingerprint()
    with pytest.raises(LayoutMismatch, match=field):
        layout.check_compatible(other)


def test_fingerprint_is_pinned():
    # A change here breaks every deployed peer's handshake: bump it only on purpose.
    layout = KVLayout(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16)
    assert layout.fingerprint() == KVLayout(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16).fingerprint()
    assert layout.page_bytes == 16 * 8 * 128 * 2 == 32768
    assert layout.token_bytes == 36 * 2 * 8 * 128 * 2


def test_dtype_mismatch_is_named():
    a = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_size=32)
    b = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_size=32, dtype="float16")
    with pytest.raises(LayoutMismatch, match=r"dtype: local='bfloat16' remote='float16'"):
        a.check_compatible(b)


@pytest.mark.parametrize("kwargs, field", [
    ({"num_layers": 0}, "layout.num_layers"), ({"dtype": "fp7"}, "layout.dtype"),
    ({"tp_rank": 2, "tp_size": 2}, "layout.tp_rank"),
])
def test_bad_layout_names_the_field(kwargs, field):
    base = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "page_size": 32}
    with pytest.raises(ConfigError, match=field):
        KVLayout(**{**base, **kwargs})


def test_heads_per_rank_replicates_below_tp():
    assert KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, page_size=32, tp_size=4).kv_heads_per_rank == 1
    assert KVLayout(num_layers=1, num_kv_heads=8, head_dim=32, page_size=32, tp_size=2).kv_heads_per_rank == 4


def _byte_map(local, remote):
    """Which remote byte every local byte lands on."""
    out = {}
    for a, b in zip(local, remote):
        for i in range(a.length):
            out[(a.region, a.offset + i)] = (b.region, b.offset + i)
    return out


# Non-overlapping single-unit spans on both sides: (local region, local unit, remote region, remote unit).
span_pairs = st.lists(
    st.tuples(st.integers(0, 1), st.integers(0, 40), st.integers(0, 1), st.integers(0, 40)),
    max_size=60, unique_by=(lambda t: (t[0], t[1]), lambda t: (t[2], t[3])),
)
UNIT = 4


@given(span_pairs)
def test_coalesce_moves_the_same_bytes(pairs):
    local = [Span(r, o * UNIT, UNIT) for r, o, _, _ in pairs]
    remote = [Span(r, o * UNIT, UNIT) for _, _, r, o in pairs]
    cl, cr = (to_spans(x) for x in coalesce(local, remote))
    assert total_bytes(cl) == total_bytes(local) == total_bytes(cr)
    assert len(cl) <= len(local)
    assert _byte_map(cl, cr) == _byte_map(local, remote)
    # maximal: no two neighbours could still be merged
    for (a, b), (c, d) in zip(zip(cl, cr), zip(cl[1:], cr[1:])):
        assert not (a.region == c.region and a.end == c.offset and b.region == d.region and b.end == d.offset)
    assert tuple(map(to_spans, coalesce(cl, cr))) == (cl, cr)  # idempotent


@given(st.permutations(list(range(64))))
def test_pages_in_any_order_coalesce_to_one_run(order):
    local = page_spans(0, order, 4096)
    remote = page_spans(1, order, 4096, base=8192)
    cl, cr = (to_spans(x) for x in coalesce(local, remote))
    assert cl == [Span(0, 0, 64 * 4096)] and cr == [Span(1, 8192, 64 * 4096)]


def test_coalesce_rejects_unpaired_spans():
    with pytest.raises(ValueError, match="1 local spans but 2 remote"):
        coalesce([Span(0, 0, 4)], [Span(0, 0, 4), Span(0, 4, 4)])
    with pytest.raises(ValueError, match="local length 4 != remote length 8"):
        coalesce([Span(0, 0, 4)], [Span(0, 0, 8)])


def test_check_spans_names_the_bad_span():
    regions = [Region(0x1000, 100)]
    check_spans([Span(0, 0, 100)], regions, "local")
    with pytest.raises(ValueError, match=r"local span 1 \[96, 104\) is outside region 0 of 100 bytes"):
        check_spans([Span(0, 0, 4), Span(0, 96, 8)], regions, "local")
    with pytest.raises(ValueError, match="remote span 0 has length 0"):
        check_spans([Span(0, 0, 0)], regions, "remote")
    with pytest.raises(ValueError, match="names region 3; 1 region"):
        check_spans([Span(3, 0, 1)], regions, "local")


def test_check_spans_refuses_a_batch_over_two_devices():
    """KV pages on a GPU and metadata rows in host memory (SGLang's aux buffers) go as two transfers."""
    regions = [Region(0x1000, 100, "cuda:0"), Region(0x9000, 100, "cpu"), Region(0xa000, 100, "cpu")]
    check_spans([Span(1, 0, 10), Span(2, 0, 10)], regions, "local")  # host only: fine
    check_spans([Span(0, 0, 10)], regions, "local")  # GPU only: fine
    with pytest.raises(ValueError, match="spans cover memory on cpu and cuda:0; .*one transfer per device"):
        check_spans([Span(0, 0, 10), Span(1, 0, 10)], regions, "local")


@given(st.lists(st.integers(1, 50), min_size=1, max_size=20), st.integers(1, 16))
def test_split_spans_keeps_bytes_and_bounds_pieces(lengths, max_bytes):
    offsets = np.cumsum([0] + lengths[:-1])
    local = span_array([Span(0, int(o), n) for o, n in zip(offsets, lengths)])
    remote = local.copy()
    remote[:, 1] += 1000
    sl, sr = split_spans(local, remote, max_bytes)
    assert (sl[:, 2] <= max_bytes).all() and sl[:, 2].sum() == sum(lengths)
    assert _byte_map(to_spans(sl), to_spans(sr)) == _byte_map(to_spans(local), to_spans(remote))


def test_span_array_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"shape \(n, 3\)"):
        span_array(np.zeros((2, 2)))
