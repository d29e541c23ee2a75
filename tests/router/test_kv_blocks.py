"""Block keys and one source's blocks, compiled (kvindex/_kvindex.c) and in Python (kvindex/pure_python.py):
the same answers, every msgpack integer width, every kind of engine hash, copies, churn."""

from __future__ import annotations

import msgspec
import pytest
from kvevents import BS, feed, blocks
from pdsdk.router.kvindex import KVIndex
from pdsdk.router.kvindex.wire import WireError, decode_batch
from pdsdk.testing import fake_kv_events as fe

# every msgpack integer width, both signs, and token ids as they come
EDGE_IDS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, -1, -32, -33, -128, -129,
            -32768, -32769, -2**31, -2**31 - 1, -2**63, 151935, 7, 42]


@pytest.mark.parametrize("encoder", ["msgspec", "msgpack"])
def test_keys_from_event_bytes_equal_keys_from_a_prompt(keys_by, encoder):
    """An event's token ids are keyed from their msgpack bytes, a prompt's from its list: the same."""
    encode = msgspec.msgpack.encode if encoder == "msgspec" else pytest.importorskip("msgpack").packb
    for toks in (EDGE_IDS, EDGE_IDS[:8], list(range(70_000))):  # fixarray, array16, array32 headers
        n = len(toks) // BS
        assert keys_by(5, encode(toks), BS, n) == keys_by(5, toks, BS, n)
        assert keys_by(5, encode(toks), BS, n + 1) is None  # fewer ids than blocks
    keys = keys_by(0, EDGE_IDS, BS, 6)
    swapped = EDGE_IDS[:9] + [EDGE_IDS[10], EDGE_IDS[9]] + EDGE_IDS[11:]  # two ids of block 2 swapped
    assert keys_by(0, swapped, BS, 6)[:2] == keys[:2] and not set(keys_by(0, swapped, BS, 6)[2:]) & set(keys)
    assert keys_by(1, EDGE_IDS, BS, 6)[0] != keys[0]  # another parent
    assert keys_by(0, tuple(EDGE_IDS), BS, 6) == keys  # a prompt may come as a tuple


def test_token_ids_that_are_not_ints_are_never_indexed(keys_by):
    with pytest.raises(WireError, match="token_ids"):
        keys_by(0, msgspec.msgpack.encode(["a", "b", "c", "d"]), BS, 1)
    with pytest.raises(WireError, match="token_ids"):
        keys_by(0, msgspec.msgpack.encode({"not": "a list"}), BS, 1)
    bad = [0.0, [{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                  "token_ids": ["a", "b", "c", "d"], "block_size": BS}]]
    idx = KVIndex()
    assert idx.apply("s", decode_batch(msgspec.msgpack.encode(bad))[1]) == 0 and idx.counts["ignored"] == 1
    assert idx.lookup(["a", "b", "c", "d"]) == {}


def _both_indexes(monkeypatch):
    from pdsdk.router import kvindex

    if kvindex._compiled is None:
        pytest.skip("pdsdk was installed without its compiled index (no C compiler)")
    compiled = KVIndex()
    monkeypatch.setattr(kvindex, "_compiled", None)
    return compiled, KVIndex()


def test_a_block_held_twice_stays_until_both_copies_go(keys_by):
    """Same content under two engine hashes (vLLM's cache_salt changes the hash, not the tokens)
    and the same event applied twice (a replay): the index counts copies, not events."""
    toks = list(range(8))
    h1, h2 = blocks(toks, salt=1), blocks(toks, salt=2)
    idx = KVIndex()
    for h in (h1, h2, h1):  # h1 again: a replay
        feed(idx, "s", "vllm", fe.stored("vllm", h, None, toks, BS))
    assert idx.sources() == {"s": 4} and idx.lookup(toks) == {"s": 8}
    feed(idx, "s", "vllm", fe.removed("vllm", h1))
    assert idx.lookup(toks) == {"s": 8}  # h2's copies still hold the content
    feed(idx, "s", "vllm", fe.removed("vllm", h2[1:]))
    assert idx.lookup(toks) == {"s": 4}
    feed(idx, "s", "vllm", fe.removed("vllm", h2[:1] + h1))  # h1 is gone already: harmless
    assert idx.lookup(toks) == {} and idx.sources() == {"s": 0}


def test_engine_hashes_of_every_kind(keys_by):
    """Hash 0, negative (SGLang's signed 64-bit), the largest unsigned 64-bit and bytes (vLLM with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) are kept apart and found again."""
    toks = list(range(5 * BS))
    h = [0, -1, 2**64 - 2, b"\x00" * 32, b"\x00" * 31 + b"\x01"]
    idx = KVIndex()
    feed(idx, "s", "sglang", fe.stored("sglang", h[:2], None, toks[:2 * BS], BS))
    for i in range(2, 5):  # each from its parent
        feed(idx, "s", "vllm", fe.stored("vllm", h[i:i + 1], h[i - 1], toks[i * BS:(i + 1) * BS], BS))
    assert idx.lookup(toks) == {"s": 5 * BS} and idx.counts["orphans"] == 0
    feed(idx, "s", "vllm", fe.removed("vllm", [h[3]]))
    assert idx.lookup(toks) == {"s": 3 * BS} and idx.sources() == {"s": 4}
    feed(idx, "s", "vllm", fe.removed("vllm", [h[0]]))
    assert idx.lookup(toks) == {}
    bad = [0.0, [{"type": "BlockStored", "block_hashes": [1.5], "parent_block_hash": None, "token_ids": toks[:BS],
                  "block_size": BS}]]
    assert idx.apply("s", decode_batch(msgspec.msgpack.encode(bad))[1]) == 0 and idx.counts["ignored"] == 1


def test_compiled_and_python_indexes_agree_under_churn(monkeypatch):
    """The compiled tables (resizes, deletions that move entries back, key 0) against the
    Python dicts: thousands of random stores, removals and clears, the same answers throughout."""
    import random

    compiled, python = _both_indexes(monkeypatch)
    rng = random.Random(7)
    prompts = [[rng.randrange(200_000) for _ in range(rng.randrange(1, 40) * BS)] for _ in range(300)]
    hashes = [[0] if i == 0 else blocks(p, salt=i) for i, p in enumerate(prompts)]
    hashes[0] = [0] + blocks(prompts[0], salt=0)[1:]
    most = 0
    for step in range(6000):
        i = rng.randrange(len(prompts))
        src = f"s{rng.randrange(3)}"
        toks, h = prompts[i], hashes[i]
        r = rng.random()
        if r < 0.7:  # a stretch of blocks from a known parent (or the root)
            a = 0 if rng.random() < 0.4 else rng.randrange(len(h))
            b = rng.randrange(a, len(h)) + 1
            ev = [fe.stored("vllm", h[a:b], h[a - 1] if a else None, toks[a * BS:b * BS], BS)]
        elif r < 0.999:
            ev = [fe.removed("vllm", rng.sample(h, min(len(h), rng.randrange(1, 5))))]
        else:
            ev = [fe.cleared("vllm")]
        payload = fe.encode_batch("vllm", ev)
        assert compiled.apply(src, decode_batch(payload)[1]) == python.apply(src, decode_batch(payload)[1])
        if step % 50 == 0:
            assert compiled.sources() == python.sources(), step
            most = max(most, *compiled.sources().values())
            for p in rng.sample(prompts, 10):
                assert compiled.lookup(p) == python.lookup(p), step
    assert compiled.counts == python.counts and compiled.counts["removed"] > 1000
    assert most > 500 and compiled.counts["cleared"] > 2  # the tables grew several times


def test_absurd_block_sizes_are_refused_not_overflowed(keys_by):
    assert keys_by(0, list(range(8)), 2**62, 4) is None
    with pytest.raises(WireError):
        keys_by(0, list(range(8)), 0, 1)
    idx = KVIndex()
    huge = [0.0, [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                   "token_ids": list(range(8)), "block_size": 2**62}]]
    assert idx.apply("s", decode_batch(msgspec.msgpack.encode(huge))[1]) == 0 and idx.counts["ignored"] == 2
