"""Store keys: a namespace (model, KV layout fingerprint, TP rank) followed by a page hash.

Page hashes are chained from the prefix, so one key stands for every token before it. pdsdk's own
chain is SGLang's (`get_hash_str` in its mem_cache): page i = sha256(digest of page i-1 || token ids
as little-endian u32), the first page with no parent. Engine-supplied hashes (vLLM's block hashes,
see vllm_hash.py; SGLang's hex strings; KV-event ints) can be used instead: `KeySpace.keys`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

import msgspec

PageHash = bytes | str | int  # digest bytes, a hex string (SGLang), or a 64-bit event int


def sglang_page_hashes(tokens: Sequence[int], page_size: int, prior: str | None = None) -> list[str]:
    """SGLang's `get_hash_str` chain over every full page of `tokens`, as hex strings."""
    out, parent = [], bytes.fromhex(prior) if prior else b""
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size:(i + 1) * page_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{len(page)}I", *page)).digest()
        out.append(parent.hex())
    return out


def sglang_event_int(hex_hash: str) -> int:
    """The signed int64 SGLang's KV events carry for a page (`hash_str_to_int64`)."""
    value = int(hex_hash[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


class KeySpace(msgspec.Struct, frozen=True, kw_only=True):
    """Who may share pages: the same model with the same KV layout, and the same TP rank when
    pages differ per rank (MHA/GQA). MLA pages are identical on every rank: tp_rank=None."""

    model: str
    layout: str  # KVLayout.fingerprint()
    tp_rank: int | None = None
    tp_size: int = 1

    @classmethod
    def for_layout(cls, model: str, layout) -> KeySpace:
        """From a pdsdk KVLayout: per-rank keys for split K/V pages, shared keys for MLA."""
        return cls(model=model, layout=layout.fingerprint(),
                   tp_rank=layout.tp_rank if layout.kv_split else None, tp_size=layout.tp_size)

    @property
    def prefix(self) -> bytes:
        rank = "*" if self.tp_rank is None else f"{self.tp_rank}/{self.tp_size}"
        return hashlib.blake2b(f"pdsdk1|{self.model}|{self.layout}|{rank}".encode(), digest_size=16).digest()

    def keys(self, page_hashes: Iterable[PageHash]) -> list[bytes]:
        """Store keys for page hashes from any source (bytes, hex strings or 64-bit ints)."""
        prefix = self.prefix
        return [prefix + _hash_bytes(h) for h in page_hashes]

    def token_keys(self, tokens: Sequence[int], page_size: int) -> list[bytes]:
        """Keys for every full page of `tokens` with pdsdk's (SGLang's) chain."""
        return self.keys(sglang_page_hashes(tokens, page_size))


def _hash_bytes(h: PageHash) -> bytes:
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    if isinstance(h, str):
        return bytes.fromhex(h)
    if isinstance(h, int):
        return (h & ((1 << 64) - 1)).to_bytes(8, "big")  # signed event ints map to their u64
    raise TypeError(f"a page hash is bytes, a hex string or an int, got {type(h).__name__}")
