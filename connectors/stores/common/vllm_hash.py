"""vLLM's block hashes, reproduced byte for byte without importing vLLM (or pickle).

vLLM (v1/core/kv_cache_utils.py, `prefix_caching_hash_algo`) hashes block i as
    sha256(pickle.dumps((parent, tuple(block_tokens), extra_keys), protocol=5))        "sha256"
    sha256(cbor2.dumps((parent, tuple(block_tokens), extra_keys), canonical=True))     "sha256_cbor"
with parent = the previous block's digest, or NONE_HASH for the first block. Both encodings are
deterministic for the few types that occur (None, bool, int, bytes, str, tuple), so this module
writes them itself: a small, exact encoder is safer to depend on than pickle.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import Any

# -- pickle protocol 5, as CPython's C pickler writes it ------------------------------------------
_FRAME_MIN = 4  # a frame smaller than this gets no FRAME opcode
_FRAME_TARGET = 64 * 1024


class _Pickle5:
    def __init__(self) -> None:
        self.frame = bytearray()
        self.memo: dict[int, int] = {}
        self.keep: list[Any] = []  # keeps memoized objects alive so their ids stay unique

    def dumps(self, obj: Any) -> bytes:
        self.save(obj)
        self.frame += b"."  # STOP
        if len(self.frame) >= _FRAME_TARGET:
            raise ValueError("input too large to reproduce pickle's framing exactly")
        head = b"\x80\x05"  # PROTO 5
        if len(self.frame) >= _FRAME_MIN:
            head += b"\x95" + struct.pack("<Q", len(self.frame))  # FRAME
        return head + bytes(self.frame)

    def memoize(self, obj: Any) -> None:
        self.memo[id(obj)] = len(self.memo)
        self.keep.append(obj)
        self.frame += b"\x94"  # MEMOIZE

    def get(self, obj: Any) -> bool:
        idx = self.memo.get(id(obj))
        if idx is None:
            return False
        self.frame += b"h" + bytes([idx]) if idx < 256 else b"j" + struct.pack("<I", idx)
        return True

    def save(self, obj: Any) -> None:
        w = self.frame
        if obj is None:
            w += b"N"
        elif obj is True or obj is False:
            w += b"\x88" if obj else b"\x89"
        elif type(obj) is int:
            if 0 <= obj <= 0xFF:
                w += b"K" + bytes([obj])
            elif 0 <= obj <= 0xFFFF:
                w += b"M" + struct.pack("<H", obj)
            elif -0x80000000 <= obj <= 0x7FFFFFFF:
                w += b"J" + struct.pack("<i", obj)
            else:
                raw = obj.to_bytes((obj.bit_length() >> 3) + 1, "little", signed=True)
                if obj < 0 and len(raw) > 1 and raw[-1] == 0xFF and raw[-2] & 0x80:
                    raw = raw[:-1]
                w += b"\x8a" + bytes([len(raw)]) + raw  # LONG1
        elif type(obj) is bytes:
            if self.get(obj):
                return
            n = len(obj)
            w += (b"C" + bytes([n]) if n <= 0xFF else b"B" + struct.pack("<I", n)) + obj
            self.memoize(obj)
        elif type(obj) is str:
            if self.get(obj):
                return
            raw = obj.encode("utf-8", "surrogatepass")
            n = len(raw)
            w += (b"\x8c" + bytes([n]) if n <= 0xFF else b"X" + struct.pack("<I", n)) + raw
            self.memoize(obj)
        elif type(obj) is tuple:
            self.save_tuple(obj)
        else:
            raise TypeError(f"cannot reproduce vLLM's hash of a {type(obj).__name__}")

    def save_tuple(self, obj: tuple) -> None:
        if not obj:
            self.frame += b")"  # EMPTY_TUPLE
            return
        if self.get(obj):
            return
        if len(obj) <= 3:
            for item in obj:
                self.save(item)
            if self.get(obj):  # recursive tuples only; cannot happen for hash inputs
                raise TypeError("recursive tuple")
            self.frame += (b"\x85", b"\x86", b"\x87")[len(obj) - 1]  # TUPLE1..3
        else:
            self.frame += b"("  # MARK
            for item in obj:
                self.save(item)
            self.frame += b"t"  # TUPLE
        self.memoize(obj)


def pickle5(obj: Any) -> bytes:
    return _Pickle5().dumps(obj)


# -- canonical CBOR, as cbor2.dumps(obj, canonical=True) writes it --------------------------------
def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise ValueError("integer too large for canonical CBOR")


def cbor(obj: Any) -> bytes:
    if obj is None:
        return b"\xf6"
    if obj is True or obj is False:
        return b"\xf5" if obj else b"\xf4"
    if type(obj) is int:
        major, n = (0, obj) if obj >= 0 else (1, -1 - obj)
        if n < 1 << 64:
            return _cbor_head(major, n)
        raw = n.to_bytes((n.bit_length() + 7) // 8, "big")  # a bignum: tag 2 (or 3) over bytes
        return _cbor_head(6, 2 + major) + _cbor_head(2, len(raw)) + raw
    if type(obj) is bytes:
        return _cbor_head(2, len(obj)) + obj
    if type(obj) is str:
        raw = obj.encode("utf-8")
        return _cbor_head(3, len(raw)) + raw
    if type(obj) in (tuple, list):
        return _cbor_head(4, len(obj)) + b"".join(cbor(x) for x in obj)
    raise TypeError(f"cannot reproduce vLLM's hash of a {type(obj).__name__}")


# -- the block hashes --------------------------------------------------------------------------------
ENCODERS = {"sha256": pickle5, "sha256_cbor": cbor}


def hash_fn(algo: str):
    try:
        encode = ENCODERS[algo]
    except KeyError:
        raise ValueError(f"unknown vLLM hash {algo!r}; reproducible ones: {', '.join(ENCODERS)}") from None
    return lambda obj: hashlib.sha256(encode(obj)).digest()


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """The parent of a sequence's first block. vLLM derives it from PYTHONHASHSEED when that is
    set (`seed`), which every engine sharing a cache must do; unseeded, the vLLM 0.32 CPU build
    used hash_fn("vllm-none-hash"), and newer ones draw random bytes."""
    return hash_fn(algo)(seed if seed is not None else "vllm-none-hash")


def block_hashes(tokens: Sequence[int], block_size: int, *, algo: str = "sha256", seed: str | None = None,
                 parent: bytes | None = None, extra_keys: Iterable[Any] | None = None) -> list[bytes]:
    """vLLM's hash of every full block of `tokens` (a partial last block has none).
    `extra_keys`: one entry per block (a tuple, or None), as vLLM's generate_block_hash_extra_keys."""
    h = hash_fn(algo)
    parent = parent if parent is not None else none_hash(algo, seed)
    extras = list(extra_keys) if extra_keys is not None else None
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(int(t) for t in tokens[i * block_size:(i + 1) * block_size])
        parent = h((parent, block, extras[i] if extras else None))
        out.append(parent)
    return out


def event_int(digest: bytes) -> int:
    """The 64-bit int vLLM's KV events carry for a block hash (the digest's last 8 bytes)."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)
