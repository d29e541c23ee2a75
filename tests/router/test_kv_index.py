"""The exact KV index: stores, lookups, removals and clears per source; content keys that match
across engines and batchings; salts, extra keys and LoRA blocks never matched by a plain prompt."""

from __future__ import annotations

import pytest
from kvevents import BS, feed, blocks
from pdsdk.router.kvindex import KVIndex
from pdsdk.testing import fake_kv_events as fe


def test_index_store_lookup_remove_clear():
    fmt = "vllm"
    idx = KVIndex()
    toks = list(range(16))
    h = blocks(toks)
    feed(idx, "a", fmt, fe.stored(fmt, h[:2], None, toks[:8], BS))
    feed(idx, "a", fmt, fe.stored(fmt, h[2:], h[1], toks[8:], BS))  # continues from its parent
    feed(idx, "b", fmt, fe.stored(fmt, h[:1], None, toks[:4], BS))
    assert idx.lookup(toks + [99]) == {"a": 16, "b": 4}
    assert idx.lookup([5] + toks) == {}
    feed(idx, "b", fmt, fe.removed(fmt, h[:1]))  # b's removal leaves a's copy alone
    assert idx.lookup(toks) == {"a": 16}
    feed(idx, "a", fmt, fe.removed(fmt, h[2:3]))
    assert idx.lookup(toks) == {"a": 8}
    feed(idx, "a", fmt, fe.cleared(fmt))
    assert idx.lookup(toks) == {} and idx.sources()["a"] == 0


def test_index_never_claims_what_it_cannot_key():
    fmt = "sglang"
    idx = KVIndex()
    toks = list(range(8))
    h = blocks(toks)
    feed(idx, "a", fmt, fe.stored(fmt, h[1:], h[0], toks[4:], BS))  # parent never seen: orphan
    feed(idx, "a", fmt, fe.stored(fmt, h[:1], None, toks[:4], BS, medium="CPU_PINNED"))  # other tier
    assert idx.lookup(toks) == {} and idx.counts["orphans"] == 1 and idx.counts["ignored"] == 1


@pytest.mark.parametrize("fmt", ["vllm-array", "sglang"])
def test_same_content_same_key_across_engines(fmt):
    """The index keys by content: two engines with different hash functions match the same prompt."""
    idx = KVIndex()
    toks = list(range(12))
    feed(idx, "x", fmt, fe.stored(fmt, blocks(toks, salt=1), None, toks, BS))
    feed(idx, "y", fmt, fe.stored(fmt, blocks(toks, salt=2), None, toks, BS))
    assert idx.lookup(toks) == {"x": 12, "y": 12}


def test_keys_do_not_depend_on_how_blocks_were_batched():
    """One block per event (the single-block fast path), all in one event, or uneven splits
    give the same content keys, which are also what a lookup computes."""
    from pdsdk.router.kvindex import prompt_keys

    toks = list(range(1000, 1000 + 10 * BS))
    h = blocks(toks)
    splits = {"one": [(0, 10)], "singles": [(i, i + 1) for i in range(10)], "uneven": [(0, 3), (3, 4), (4, 10)]}
    for name, parts in splits.items():
        idx = KVIndex()
        for a, b in parts:
            feed(idx, "s", "vllm", fe.stored("vllm", h[a:b], h[a - 1] if a else None, toks[a * BS:b * BS], BS))
        assert idx.lookup(toks) == {"s": 10 * BS}, name
        held = idx._blocks["s"]
        assert len(held) == 10 and [held.key(x) for x in h] == prompt_keys(toks, BS), name
    keys = prompt_keys(toks, BS)
    assert len(set(keys)) == 10 and prompt_keys(toks[BS:], BS)[0] not in keys  # position matters
    assert prompt_keys(toks[:BS] * 2, BS)[1] != prompt_keys(toks[:BS], BS)[0]  # same block, deeper: new key


def test_extra_keys_and_lora_blocks_are_never_matched_by_base_lookups():
    toks = list(range(8))
    h = blocks(toks)
    idx = KVIndex()
    feed(idx, "mm", "vllm", fe.stored("vllm", h, None, toks, BS, extra_keys=[["img-hash"], None]))
    feed(idx, "lora", "vllm", fe.stored("vllm", h, None, toks, BS, lora_id=3))
    feed(idx, "lora1", "vllm", fe.stored("vllm", h[:1], None, toks[:4], BS, lora_id=3))  # single-block path
    assert idx.lookup(toks) == {} and idx.counts["stored"] == 5


def test_salts_and_extra_keys_as_the_engines_send_them():
    """vLLM sends extra_keys per block, [None] * n for plain text (what real vLLM 0.32 publishes):
    those blocks match. From the first block with extra keys (an image, vLLM's cache salt) on,
    nothing matches a plain prompt, children included; SGLang's cache_salt and a LoRA given by
    name only (lora_id None) are never matched either."""
    toks = list(range(4 * BS))
    h = blocks(toks)
    idx = KVIndex()
    feed(idx, "plain", "vllm", fe.stored("vllm", h, None, toks, BS, extra_keys=[None] * 4))
    feed(idx, "image", "vllm", fe.stored("vllm", h[:3], None, toks[:3 * BS], BS, extra_keys=[None, ["img"], None]))
    feed(idx, "image", "vllm", fe.stored("vllm", h[3:], h[2], toks[3 * BS:], BS, extra_keys=[None]))  # a child
    feed(idx, "salted", "vllm", fe.stored("vllm", h, None, toks, BS, extra_keys=[["salt"], None, None, None]))
    feed(idx, "sgl-salt", "sglang", fe.stored("sglang", h, None, toks, BS, cache_salt="s"))
    feed(idx, "sgl-lora", "sglang", fe.stored("sglang", h, None, toks, BS, lora_name="adapter"))
    assert idx.lookup(toks) == {"plain": 4 * BS, "image": BS}
    assert idx.counts["stored"] == 4 + 3 + 1 + 4 + 4 + 4 and idx.counts["orphans"] == 0


def test_removals_and_clears_per_source():
    toks = list(range(12))
    h = blocks(toks)
    idx = KVIndex()
    for src in ("a", "b"):
        feed(idx, src, "sglang", fe.stored("sglang", h, None, toks, BS))
    feed(idx, "a", "sglang", fe.removed("sglang", [h[0], 12345]))  # an unknown hash is harmless
    assert idx.lookup(toks) == {"b": 12} and idx.counts["removed"] == 2
    feed(idx, "b", "sglang-array", fe.cleared("sglang-array"))
    assert idx.lookup(toks) == {} and idx.sources() == {"a": 2, "b": 0}
    idx.drop("a")
    assert idx.sources() == {"b": 0}
    feed(idx, "a", "vllm", fe.removed("vllm", h))  # a dropped source comes back empty
    assert idx.sources()["a"] == 0


def test_index_works_with_either_hasher(keys_by):
    test_index_store_lookup_remove_clear()
    test_keys_do_not_depend_on_how_blocks_were_batched()
