"""KV cache event wire formats of vLLM and SGLang.

ZMQ PUB multipart: [topic, seq, payload]. seq is 8 bytes big-endian, or 24 bytes (seq + 16-byte
publisher id) on vLLM newer than 0.33 with a snapshot endpoint. payload is a msgpack array
[ts, events, data_parallel_rank]. Each event is either
- a map tagged by "type" (vLLM 0.33, SGLang >= 0.5.20; None-valued optionals may be omitted), or
- a positional array whose first item is the tag (older vLLM, SGLang <= 0.5.15):
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...],
  ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"].
Hashes are opaque: ints (vLLM: low 64 bits of sha256; SGLang: signed int64) or raw bytes.

Decoding is batch-at-a-time with typed msgspec structs (one C call per batch, no per-event
Python objects besides the event structs themselves). A BlockStored's token ids stay msgpack
(msgspec.Raw) for the index's compiled hasher, which keys blocks without a Python int per token;
`as_ints(ev.token_ids)` gives them as ints. Fields the structs do not name are
ignored (unknown map keys, trailing array items), so fields added by newer engines never break
the router. A batch the typed decoders reject (an event type we do not know, a field of an
unexpected type, a map-shaped batch) is decoded again generically, event by event, with the
same result: unknown event types are skipped.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

END_SEQ = -1
Hash = int | bytes
STORED, REMOVED, CLEARED = 1, 2, 3


class Stored(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    """BlockStored. As a class it decodes the positional form: the first six fields only, as the
    engines' positional layouts differ after `medium`. StoredMap adds the map form's fields.
    `token_ids` is the msgpack array as it came (or a list, from the generic decoder)."""
    block_hashes: list[Hash]
    parent: Hash | None = msgspec.field(name="parent_block_hash")
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    extra_keys: ClassVar[Any] = None
    group_idx: ClassVar[Any] = None
    lora_name: ClassVar[Any] = None
    cache_salt: ClassVar[Any] = None
    kind: ClassVar[int] = STORED


class StoredMap(Stored, array_like=False):
    extra_keys: Any = None  # vLLM: per block, None or that block's extra keys (multimodal hashes, cache salt)
    group_idx: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None  # SGLang: the request's salt, for every page it stores


class Removed(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: ClassVar[Any] = None
    kind: ClassVar[int] = REMOVED


class RemovedMap(Removed, array_like=False):
    group_idx: int | None = None


class Cleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    kind: ClassVar[int] = CLEARED


class ClearedMap(Cleared, array_like=False):
    pass


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float | int
    events: list[StoredMap | RemovedMap | ClearedMap]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float | int
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None


_typed = [msgspec.msgpack.Decoder(_MapBatch), msgspec.msgpack.Decoder(_ArrayBatch)]
_generic = msgspec.msgpack.Decoder()
_ints = msgspec.msgpack.Decoder(list[int])


def as_ints(tokens) -> list | tuple:
    """A BlockStored's `token_ids` as ints, decoded when they are msgpack bytes (a list or a tuple
    stays as it is); WireError when msgpack bytes are not an array of ints."""
    if isinstance(tokens, (list, tuple)):
        return tokens
    try:
        return _ints.decode(tokens)
    except (msgspec.DecodeError, TypeError) as e:  # ValidationError included
        raise WireError(f"token_ids: {e}") from None


class WireError(ValueError):
    """A message that is not a KV event batch."""


def parse_seq(frame: bytes) -> tuple[int, bytes | None]:
    """(seq, publisher id or None). -1 marks the end of a replay."""
    if len(frame) == 8:
        return int.from_bytes(frame, "big", signed=True), None
    if len(frame) == 24:
        return int.from_bytes(frame[:8], "big", signed=True), bytes(frame[8:])
    raise WireError(f"sequence frame of {len(frame)} bytes (expected 8 or 24)")


def decode_batch(payload: bytes) -> tuple[float, list, int | None]:
    """(timestamp, events, data_parallel_rank) from one payload. Events are Stored/Removed/Cleared
    (or their *Map subclasses); `ev.kind` is STORED, REMOVED or CLEARED."""
    for i, dec in enumerate(_typed):
        try:
            b = dec.decode(payload)
        except msgspec.ValidationError:
            continue
        except msgspec.DecodeError as e:
            raise WireError(f"payload is not msgpack: {e}") from None
        if i:  # an engine sends one encoding: try the one that worked first next time
            _typed.reverse()
        return b.ts, b.events, b.data_parallel_rank
    return _decode_generic(payload)


def _decode_generic(payload: bytes) -> tuple[float, list, int | None]:
    try:
        obj = _generic.decode(payload)
    except msgspec.DecodeError as e:
        raise WireError(f"payload is not msgpack: {e}") from None
    if isinstance(obj, dict):
        ts, events, rank = obj.get("ts", 0.0), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, list) and len(obj) >= 2:
        ts, events, rank = obj[0], obj[1], (obj[2] if len(obj) > 2 else None)
    else:
        raise WireError(f"payload is a {type(obj).__name__}, not a KV event batch")
    if not isinstance(events, list):
        raise WireError("batch has no event list")
    return ts, [ev for ev in (_event(e) for e in events) if ev is not None], rank


def _event(e) -> Stored | Removed | Cleared | None:
    """One event in either encoding; unknown event types are skipped (newer engines add some)."""
    if isinstance(e, dict):
        kind = e.get("type")
        if kind == "BlockStored":
            return StoredMap(e.get("block_hashes") or [], e.get("parent_block_hash"), e.get("token_ids") or [],
                             e.get("block_size") or 0, e.get("lora_id"), e.get("medium"), e.get("extra_keys"),
                             e.get("group_idx"), e.get("lora_name"), e.get("cache_salt"))
        if kind == "BlockRemoved":
            return RemovedMap(e.get("block_hashes") or [], e.get("medium"), e.get("group_idx"))
        if kind == "AllBlocksCleared":
            return ClearedMap()
        return None
    if isinstance(e, list) and e:
        kind, f = e[0], e[1:]
        if kind == "BlockStored" and len(f) >= 4:
            return Stored(f[0] or [], f[1], f[2] or [], f[3] or 0, f[4] if len(f) > 4 else None,
                          f[5] if len(f) > 5 else None)
        if kind == "BlockRemoved" and f:
            return Removed(f[0] or [], f[1] if len(f) > 1 else None)
        if kind == "AllBlocksCleared":
            return Cleared()
        return None
    raise WireError(f"event is a {type(e).__name__}")
