"""KV events: real msgpack bytes in the engines' wire formats, the exact index, and the ZMQ stream
(replay on start and on gaps, lossy fallback, engine restart, AllBlocksCleared)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from helpers import eventually
from pdsdk.router import fake_events as fe
from pdsdk.router.harness import Decisions, Harness, free_port
from pdsdk.router.kvindex import KVIndex
from pdsdk.router.kvsub import EventStream
from pdsdk.router.kvwire import STORED, Cleared, Removed, Stored, WireError, as_ints, decode_batch, parse_seq

FORMATS = list(fe.FORMATS)
BS = 4


def blocks(tokens, salt=0):
    return fe.chain(tokens, BS, salt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_wire_formats_decode(fmt):
    toks = list(range(8))
    h = blocks(toks)
    payload = fe.encode_batch(fmt, [fe.stored(fmt, h, None, toks, BS), fe.removed(fmt, h[1:]), fe.cleared(fmt)])
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3  # [ts, events, data_parallel_rank]
    ev0 = raw[1][0]
    if fmt.endswith("array"):
        assert ev0[0] == "BlockStored" and ev0[1] == h
    else:
        assert ev0["type"] == "BlockStored"
        if fmt == "sglang":
            assert "medium" not in ev0 and "lora_id" not in ev0  # None-valued optionals omitted
    _, events, rank = decode_batch(payload)
    assert rank == 0
    assert isinstance(events[0], Stored) and events[0].block_hashes == h and as_ints(events[0].token_ids) == toks
    assert events[0].parent is None and events[0].block_size == BS
    assert isinstance(events[1], Removed) and events[1].block_hashes == h[1:]
    assert isinstance(events[2], Cleared)


def test_wire_odd_inputs():
    assert parse_seq((5).to_bytes(8, "big")) == (5, None)
    assert parse_seq((-1).to_bytes(8, "big", signed=True))[0] == -1
    assert parse_seq((7).to_bytes(8, "big") + b"p" * 16) == (7, b"p" * 16)  # seq + publisher id
    with pytest.raises(WireError):
        parse_seq(b"123")
    with pytest.raises(WireError):
        decode_batch(b"\xc1")
    # unknown event types and bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) pass through
    payload = msgspec.msgpack.encode([0.0, [{"type": "Future"}, {"type": "BlockStored", "block_hashes": [b"x" * 32],
                                                                 "parent_block_hash": None, "token_ids": [1] * BS,
                                                                 "block_size": BS}]])
    _, events, rank = decode_batch(payload)
    assert rank is None and len(events) == 1 and events[0].block_hashes == [b"x" * 32]


def _apply(index, src, fmt, *events):
    return index.apply(src, decode_batch(fe.encode_batch(fmt, list(events)))[1])


def test_index_store_lookup_remove_clear():
    fmt = "vllm"
    idx = KVIndex()
    toks = list(range(16))
    h = blocks(toks)
    _apply(idx, "a", fmt, fe.stored(fmt, h[:2], None, toks[:8], BS))
    _apply(idx, "a", fmt, fe.stored(fmt, h[2:], h[1], toks[8:], BS))  # continues from its parent
    _apply(idx, "b", fmt, fe.stored(fmt, h[:1], None, toks[:4], BS))
    assert idx.lookup(toks + [99]) == {"a": 16, "b": 4}
    assert idx.lookup([5] + toks) == {}
    _apply(idx, "b", fmt, fe.removed(fmt, h[:1]))  # b's removal leaves a's copy alone
    assert idx.lookup(toks) == {"a": 16}
    _apply(idx, "a", fmt, fe.removed(fmt, h[2:3]))
    assert idx.lookup(toks) == {"a": 8}
    _apply(idx, "a", fmt, fe.cleared(fmt))
    assert idx.lookup(toks) == {} and idx.sources()["a"] == 0


def test_index_never_claims_what_it_cannot_key():
    fmt = "sglang"
    idx = KVIndex()
    toks = list(range(8))
    h = blocks(toks)
    _apply(idx, "a", fmt, fe.stored(fmt, h[1:], h[0], toks[4:], BS))  # parent never seen: orphan
    _apply(idx, "a", fmt, fe.stored(fmt, h[:1], None, toks[:4], BS, medium="CPU_PINNED"))  # other tier
    assert idx.lookup(toks) == {} and idx.counts["orphans"] == 1 and idx.counts["ignored"] == 1


@pytest.mark.parametrize("fmt", ["vllm-array", "sglang"])
def test_same_content_same_key_across_engines(fmt):
    """The index keys by content: two engines with different hash functions match the same prompt."""
    idx = KVIndex()
    toks = list(range(12))
    _apply(idx, "x", fmt, fe.stored(fmt, blocks(toks, salt=1), None, toks, BS))
    _apply(idx, "y", fmt, fe.stored(fmt, blocks(toks, salt=2), None, toks, BS))
    assert idx.lookup(toks) == {"x": 12, "y": 12}


# --- the ZMQ stream -------------------------------------------------------------------------

def _endpoints():
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def _wait(check, timeout=5.0):
    return eventually(check, timeout, interval=0.01)


def _publish(pub, fmt, tokens, salt=0):
    h = blocks(tokens, salt)
    return pub.publish(fe.encode_batch(fmt, [fe.stored(fmt, h, None, tokens, BS)]))


@pytest.fixture
def stream_env():
    made = []

    def make(fmt="vllm", replay=True, ep=None):
        ep = ep or _endpoints()
        pub = fe.Publisher(ep[0], ep[1] if replay else None)
        made.append(pub)
        return pub, ep

    yield make
    for p in made:
        p.close()


def test_stream_replays_history_on_start_and_fills_gaps(stream_env):
    pub, ep = stream_env()
    _publish(pub, "vllm", list(range(100, 108)))  # before the router connects
    idx = KVIndex()
    s = EventStream("w", ep[0], idx, ep[1])
    s.start()
    try:
        assert s.ready.wait(5) and idx.lookup(list(range(100, 108))) == {"w": 8}
        probe = list(range(200, 208))
        while idx.lookup(probe) != {"w": 8}:  # until the subscription is live (ZMQ slow joiner)
            _publish(pub, "vllm", probe)
            time.sleep(0.02)
        pub.drop_next(2)  # lost on the way: the next message reveals the gap
        for i in range(3):
            _publish(pub, "vllm", list(range(i * 8, i * 8 + 8)))
        assert _wait(lambda: all(idx.lookup(list(range(i * 8, i * 8 + 8))) == {"w": 8} for i in range(3)))
        assert s.counts["gaps"] >= 1 and s.state == "exact" and s.last == pub.seq - 1
    finally:
        s.stop()
        s.join(2)


def test_a_stream_whose_replay_is_empty_is_exact_at_once(stream_env):
    """An engine that has stored nothing yet: after the (empty) replay the index holds all it has."""
    pub, ep = stream_env()
    s = EventStream("w", ep[0], KVIndex(), ep[1])
    s.start()
    try:
        assert s.ready.wait(5) and s.state == "exact" and s.last is None
    finally:
        s.stop()
        s.join(2)


def test_stream_without_replay_goes_lossy_on_a_gap(stream_env):
    pub, ep = stream_env(replay=False)
    idx = KVIndex()
    s = EventStream("w", ep[0], idx, None)
    s.start()
    try:
        s.ready.wait(5)
        old = list(range(8))
        while idx.lookup(old) != {"w": 8}:  # until the subscription is live (ZMQ slow joiner)
            _publish(pub, "vllm", old)
            time.sleep(0.02)
        pub.drop_next(1)  # maybe a removal of `old` was in there: the index must forget
        _publish(pub, "vllm", [1] * 8)
        _publish(pub, "vllm", [2] * 8)
        assert _wait(lambda: s.state == "lossy")
        assert idx.lookup(old) == {} and _wait(lambda: idx.lookup([2] * 8) == {"w": 8})
    finally:
        s.stop()
        s.join(2)


def test_engine_restart_resyncs(stream_env):
    pub, ep = stream_env()
    idx = KVIndex()
    s = EventStream("w", ep[0], idx, ep[1])
    s.start()
    try:
        s.ready.wait(5)
        for i in range(5):
            _publish(pub, "vllm", [i] * 8)
        assert _wait(lambda: idx.lookup([4] * 8) == {"w": 8})
        pub.close()  # the engine dies; a new one starts on the same ports with an empty cache
        time.sleep(0.1)
        pub2, _ = stream_env(ep=ep)
        _publish(pub2, "vllm", [9] * 8)
        _publish(pub2, "vllm", [8] * 8)
        assert _wait(lambda: idx.lookup([8] * 8) == {"w": 8} and idx.lookup([9] * 8) == {"w": 8}, 10)
        assert all(idx.lookup([i] * 8) == {} for i in range(5))
        assert s.counts["restarts"] >= 1
        pub2.publish(fe.encode_batch("vllm", [fe.cleared("vllm")]))
        assert _wait(lambda: idx.lookup([8] * 8) == {})
    finally:
        s.stop()
        s.join(2)


async def _kv_events_harness(h, stream_env, fmt):
    """Give each of h's plain workers a live KV event stream of format `fmt`; their publishers."""
    pubs = [stream_env(fmt)[0:2] for _ in h.plain]
    for w, (pub, ep) in zip(h.plain, pubs):
        rw = h.router.pool.workers[w.url]
        h.router.pool.remove(w.url)
        rw.kv_events, rw.kv_replay = ep
        h.router.add_worker(rw)
    return [pub for pub, _ in pubs]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_kv_events_policy_routes_to_the_worker_holding_the_prefix(stream_env, engine):
    """Text prompts: the router gets their token ids from a worker's POST /tokenize (both engines
    serve it; --tokenize auto is the default)."""
    async def main():
        async with Harness(engine=engine, plain=2, policy="kv_events") as h:
            pubs = await _kv_events_harness(h, stream_env, engine)
            text = "the quick brown fox jumps over the lazy dog" * 2
            toks = [ord(c) for c in text]  # the fake worker's /tokenize
            policy = h.router.policies["plain"]
            for _ in range(250):  # again until seen: a subscription still joining misses what is sent
                _publish(pubs[1], engine, toks[: len(toks) // BS * BS])
                await asyncio.sleep(0.02)
                if policy.index.lookup(toks):
                    break
            for _ in range(4):
                status, _, _ = await h.post("/v1/completions", {"model": "fake-model", "prompt": text, "max_tokens": 2})
                assert status == 200
            assert len(h.plain[1].requests) == 4 and not h.plain[0].requests
            status, stats = await h.get("/admin/policies")
            assert stats["plain"]["policy"] == "kv_events" and stats["plain"]["index"]["stored"] > 0
    run(main())


def test_workers_without_tokenize_are_asked_once_then_text_prompts_use_the_prefix_match(stream_env, caplog):
    async def main():
        async with Harness(plain=2, policy="kv_events", worker_opts={"serves_tokenize": False}) as h:
            await _kv_events_harness(h, stream_env, "vllm")
            with Decisions() as seen:
                for i in range(3):
                    status, _, _ = await h.post("/v1/completions", {"model": "fake-model", "prompt": "hello world",
                                                                    "max_tokens": 2}, headers={"X-Request-Id": f"r{i}"})
                    assert status == 200
            assert len(seen) == 3 and all(r.startswith("degraded (no token ids)") for _, r in seen.values()), seen
            assert not h.router.orchestrator._ask_tokens
    with caplog.at_level("WARNING", logger="pdsdk.router.orchestrator"):
        run(main())
    assert len([r for r in caplog.records if "has no POST /tokenize" in r.getMessage()]) == 1


def run(coro):
    return asyncio.run(coro)


# --- batch-oriented ingestion ---------------------------------------------------------------

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
            _apply(idx, "s", "vllm", fe.stored("vllm", h[a:b], h[a - 1] if a else None, toks[a * BS:b * BS], BS))
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
    _apply(idx, "mm", "vllm", fe.stored("vllm", h, None, toks, BS, extra_keys=[["img-hash"], None]))
    _apply(idx, "lora", "vllm", fe.stored("vllm", h, None, toks, BS, lora_id=3))
    _apply(idx, "lora1", "vllm", fe.stored("vllm", h[:1], None, toks[:4], BS, lora_id=3))  # single-block path
    assert idx.lookup(toks) == {} and idx.counts["stored"] == 5


def test_salts_and_extra_keys_as_the_engines_send_them():
    """vLLM sends extra_keys per block, [None] * n for plain text (what real vLLM 0.32 publishes):
    those blocks match. From the first block with extra keys (an image, vLLM's cache salt) on,
    nothing matches a plain prompt, children included; SGLang's cache_salt and a LoRA given by
    name only (lora_id None) are never matched either."""
    toks = list(range(4 * BS))
    h = blocks(toks)
    idx = KVIndex()
    _apply(idx, "plain", "vllm", fe.stored("vllm", h, None, toks, BS, extra_keys=[None] * 4))
    _apply(idx, "image", "vllm", fe.stored("vllm", h[:3], None, toks[:3 * BS], BS, extra_keys=[None, ["img"], None]))
    _apply(idx, "image", "vllm", fe.stored("vllm", h[3:], h[2], toks[3 * BS:], BS, extra_keys=[None]))  # a child
    _apply(idx, "salted", "vllm", fe.stored("vllm", h, None, toks, BS, extra_keys=[["salt"], None, None, None]))
    _apply(idx, "sgl-salt", "sglang", fe.stored("sglang", h, None, toks, BS, cache_salt="s"))
    _apply(idx, "sgl-lora", "sglang", fe.stored("sglang", h, None, toks, BS, lora_name="adapter"))
    assert idx.lookup(toks) == {"plain": 4 * BS, "image": BS}
    assert idx.counts["stored"] == 4 + 3 + 1 + 4 + 4 + 4 and idx.counts["orphans"] == 0


def test_removals_and_clears_per_source():
    toks = list(range(12))
    h = blocks(toks)
    idx = KVIndex()
    for src in ("a", "b"):
        _apply(idx, src, "sglang", fe.stored("sglang", h, None, toks, BS))
    _apply(idx, "a", "sglang", fe.removed("sglang", [h[0], 12345]))  # an unknown hash is harmless
    assert idx.lookup(toks) == {"b": 12} and idx.counts["removed"] == 2
    _apply(idx, "b", "sglang-array", fe.cleared("sglang-array"))
    assert idx.lookup(toks) == {} and idx.sources() == {"a": 2, "b": 0}
    idx.drop("a")
    assert idx.sources() == {"b": 0}
    _apply(idx, "a", "vllm", fe.removed("vllm", h))  # a dropped source comes back empty
    assert idx.sources()["a"] == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_typed_decoding_matches_the_generic_decoder(fmt):
    from pdsdk.router.kvwire import _decode_generic

    toks = list(range(8))
    h = blocks(toks)
    payload = fe.encode_batch(fmt, [fe.stored(fmt, h, None, toks, BS), fe.removed(fmt, h[1:]), fe.cleared(fmt)])
    fast, slow = decode_batch(payload), _decode_generic(payload)
    assert fast[0] == slow[0] and fast[2] == slow[2]
    for a, b in zip(fast[1], slow[1], strict=True):
        assert a.kind == b.kind
        for f in ("block_hashes", "parent", "block_size", "lora_id", "medium", "extra_keys", "group_idx", "lora_name",
                  "cache_salt"):
            assert getattr(a, f, None) == getattr(b, f, None), f
        if a.kind == STORED:
            assert as_ints(a.token_ids) == as_ints(b.token_ids)


def test_batches_the_typed_decoders_refuse_still_decode():
    toks = list(range(4))
    newer = [0.5, [["BlockStored", [7], None, toks, BS, None, "GPU", "lora-x", [["extra"]], 0, "full", "new"],
                   ["SomethingNew", 1], ["BlockRemoved", [7], "GPU", 0]], 0]
    _, events, rank = decode_batch(msgspec.msgpack.encode(newer))  # unknown type, trailing fields
    assert [type(e).__name__ for e in events] == ["Stored", "Removed"] and rank == 0
    as_map = {"ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                                     "token_ids": toks, "block_size": BS, "future_field": {"x": 1}}]}
    _, events, _ = decode_batch(msgspec.msgpack.encode(as_map))  # a map-shaped batch
    assert as_ints(events[0].token_ids) == toks
    odd = [1, [{"type": "BlockStored", "block_hashes": None, "parent_block_hash": None, "token_ids": None,
                "block_size": None}]]
    _, events, _ = decode_batch(msgspec.msgpack.encode(odd))  # nulls where lists belong: generic path
    assert events[0].block_hashes == [] and KVIndex().apply("s", events) == 0


# --- block keys and blocks: compiled (router/_kvindex.c) and in Python ------------------------

# every msgpack integer width, both signs, and token ids as they come
EDGE_IDS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, -1, -32, -33, -128, -129,
            -32768, -32769, -2**31, -2**31 - 1, -2**63, 151935, 7, 42]


@pytest.fixture(params=["compiled", "python"])
def keys_by(request, monkeypatch):
    from pdsdk.router import kvindex

    if request.param == "python":
        monkeypatch.setattr(kvindex, "_compiled", None)
    elif kvindex._compiled is None:
        pytest.skip("pdsdk was installed without its compiled index (no C compiler)")
    return kvindex.chain


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


def test_index_works_with_either_hasher(keys_by):
    test_index_store_lookup_remove_clear()
    test_keys_do_not_depend_on_how_blocks_were_batched()


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
        _apply(idx, "s", "vllm", fe.stored("vllm", h, None, toks, BS))
    assert idx.sources() == {"s": 4} and idx.lookup(toks) == {"s": 8}
    _apply(idx, "s", "vllm", fe.removed("vllm", h1))
    assert idx.lookup(toks) == {"s": 8}  # h2's copies still hold the content
    _apply(idx, "s", "vllm", fe.removed("vllm", h2[1:]))
    assert idx.lookup(toks) == {"s": 4}
    _apply(idx, "s", "vllm", fe.removed("vllm", h2[:1] + h1))  # h1 is gone already: harmless
    assert idx.lookup(toks) == {} and idx.sources() == {"s": 0}


def test_engine_hashes_of_every_kind(keys_by):
    """Hash 0, negative (SGLang's signed 64-bit), the largest unsigned 64-bit and bytes (vLLM with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) are kept apart and found again."""
    toks = list(range(5 * BS))
    h = [0, -1, 2**64 - 2, b"\x00" * 32, b"\x00" * 31 + b"\x01"]
    idx = KVIndex()
    _apply(idx, "s", "sglang", fe.stored("sglang", h[:2], None, toks[:2 * BS], BS))
    for i in range(2, 5):  # each from its parent
        _apply(idx, "s", "vllm", fe.stored("vllm", h[i:i + 1], h[i - 1], toks[i * BS:(i + 1) * BS], BS))
    assert idx.lookup(toks) == {"s": 5 * BS} and idx.counts["orphans"] == 0
    _apply(idx, "s", "vllm", fe.removed("vllm", [h[3]]))
    assert idx.lookup(toks) == {"s": 3 * BS} and idx.sources() == {"s": 4}
    _apply(idx, "s", "vllm", fe.removed("vllm", [h[0]]))
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
