"""KV event wire formats: real msgpack bytes as vLLM and SGLang encode them (map and array forms),
decoded by the typed decoders and by the generic fallback."""

from __future__ import annotations

import msgspec
import pytest
from kvevents import BS, FORMATS, blocks
from pdsdk.router.kvindex import KVIndex
from pdsdk.router.kvindex.wire import STORED, Cleared, Removed, Stored, WireError, as_ints, decode_batch, parse_seq
from pdsdk.testing import fake_kv_events as fe


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


@pytest.mark.parametrize("fmt", FORMATS)
def test_typed_decoding_matches_the_generic_decoder(fmt):
    from pdsdk.router.kvindex.wire import _decode_generic

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
