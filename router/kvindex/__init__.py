"""Exact index of which engine holds which KV blocks, fed by KV cache events.

Keys are the router's own chained keys of block *content*, built from the token ids every
BlockStored carries. The engines' hashes are used only to follow parents and to apply removals.
So the index never needs the engine's hash function or its seed (PYTHONHASHSEED), and one
lookup over the prompt's token ids serves vLLM and SGLang alike.

A block's key mixes its parent's key with its token ids, from a root key per LoRA adapter: it
depends on every token of the prefix and on their order, and a child's key follows from its
parent's key alone. A cache salt (SGLang's field) or a block's extra keys (vLLM's, per block:
multimodal hashes, its cache salt) seed the chain from there on, so a plain prompt never
matches those blocks: the router does not know a request's salt or images when it looks up.

A "source" is one event stream (one engine, one DP rank). Per source the index keeps its
`Blocks`: {engine hash: content key} and how many blocks hold each content key. The compiled
Blocks (router/kvindex/_kvindex.c) keys an event's blocks straight from its msgpack token ids into
tables of 64-bit words: no Python object per token or per block. Without a C compiler at install
time, pure_python.py does the same with dicts and tuple hashes, at a fraction of the speed. Keys
never leave the process, so the two kinds never meet. Blocks whose parent the index never saw
(events lost before a resync) cannot be keyed and are counted as orphans: the index may miss
blocks, but it never claims a block an engine does not have.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from pdsdk.router.kvindex import pure_python
from pdsdk.router.kvindex.wire import CLEARED, REMOVED, STORED, WireError, as_ints

try:
    from pdsdk.router.kvindex import _kvindex as _compiled
except ImportError:  # installed without a C compiler
    _compiled = None

ROOT = 0


def _root(lora_id) -> int:
    return ROOT if lora_id is None else hash(("lora", lora_id))


def implementation():
    """The compiled index (router/kvindex/_kvindex.c), or its Python twin (pure_python.py) when pdsdk was
    installed without a C compiler: modules with the same `chain` and `Blocks`."""
    return _compiled if _compiled is not None else pure_python


def chain(key: int, tokens, block_size: int, n: int, impl=None) -> list[int] | None:
    """Keys of the n full blocks of `tokens` (a list of ints, or an event's msgpack token ids)
    that follow the block keyed `key`; None when there are fewer than block_size * n tokens."""
    try:
        return (impl or implementation()).chain(key, tokens, block_size, n)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as e:  # token ids that are not ints
        raise WireError(f"token_ids: {e}") from None


def prompt_keys(token_ids: list[int], block_size: int, lora_id=None, impl=None) -> list[int]:
    """Chained content keys of the prompt's full blocks (engines only hash full blocks); none for
    a prompt whose ids are not ints (no engine can hold it)."""
    try:
        return chain(_root(lora_id), token_ids, block_size, len(token_ids) // block_size, impl) or []
    except WireError:
        return []


def _store_with_extras(blocks, base: int, hashes: list, tokens, bs: int, extra) -> bool:
    """Blocks before the first with extra keys (a multimodal input's hash, vLLM's cache salt) are
    keyed as plain tokens; from that block on, the chain is seeded with the extra keys, so no plain
    prompt matches those blocks or their children. Rare: the token ids are decoded to slice them."""
    m = len(hashes)
    first = next((i for i, x in enumerate(extra) if x is not None), m) if isinstance(extra, list) else 0
    first = min(first, m)
    toks = as_ints(tokens)
    if len(toks) < bs * m:
        return False
    if first:
        if not blocks.store(base, hashes[:first], toks[:first * bs], bs):
            return False
        base = blocks.key(hashes[first - 1])
    rest = extra[first:] if isinstance(extra, list) else extra
    return blocks.store(hash((base, repr(rest))), hashes[first:], toks[first * bs:m * bs], bs)


class KVIndex:
    def __init__(self, mediums: Iterable[str | None] = (None, "GPU")):
        self.mediums = frozenset(mediums)
        self._impl = implementation()
        self._lock = threading.Lock()
        self._blocks: dict[str, pure_python.Blocks] = {}  # source -> its blocks (or the compiled kind)
        self.block_size: dict[str, int] = {}
        self.counts = dict.fromkeys(("stored", "removed", "cleared", "orphans", "ignored"), 0)

    def apply(self, source: str, events: list) -> int:
        """Apply one batch of decoded events from `source`; returns block events applied.
        The per-event work is inlined here: at one block per event (vLLM decode steps) the
        per-event overhead is a large part of the cost."""
        stored = removed = ignored = orphans = cleared = 0
        bs_seen = None
        mediums = self.mediums
        with self._lock:
            blocks = self._blocks.get(source)
            if blocks is None:
                blocks = self._blocks[source] = self._impl.Blocks()
            for ev in events:
                kind = ev.kind
                if kind == STORED:
                    hashes, bs = ev.block_hashes, ev.block_size
                    m = len(hashes)
                    if ev.medium not in mediums or ev.group_idx not in (None, 0) or not bs:
                        ignored += m
                        continue
                    parent = ev.parent
                    if parent is None:
                        lora = ev.lora_id if ev.lora_id is not None else ev.lora_name
                        base = ROOT if lora is None else _root(lora)
                    else:
                        base = blocks.key(parent)
                        if base is None:
                            orphans += m
                            continue
                    if ev.cache_salt is not None:
                        base = hash((base, "cache_salt", ev.cache_salt))
                    extra = ev.extra_keys  # vLLM sends [None] * m for plain blocks
                    try:
                        if extra and (type(extra) is not list or extra.count(None) != len(extra)):
                            ok = _store_with_extras(blocks, base, hashes, ev.token_ids, bs, extra)
                        else:
                            ok = blocks.store(base, hashes, ev.token_ids, bs)
                    except (TypeError, ValueError, OverflowError):  # ids or hashes of the wrong kind
                        ok = False
                    if not ok:  # also: fewer token ids than blocks
                        ignored += m
                        continue
                    stored += m
                    bs_seen = bs
                elif kind == REMOVED:
                    if ev.medium not in mediums or ev.group_idx not in (None, 0):
                        continue
                    blocks.remove(ev.block_hashes)
                    removed += len(ev.block_hashes)
                elif kind == CLEARED:
                    blocks.clear()
                    cleared += 1
            if bs_seen:
                self.block_size[source] = bs_seen
            c = self.counts
            c["stored"] += stored
            c["removed"] += removed
            c["ignored"] += ignored
            c["orphans"] += orphans
            c["cleared"] += cleared
        return stored + removed

    def clear(self, source: str) -> None:
        """Forget everything `source` held (engine restarted, unrecoverable gap, worker removed)."""
        with self._lock:
            if source in self._blocks:
                self._blocks[source].clear()
            else:
                self._blocks[source] = self._impl.Blocks()

    def drop(self, source: str) -> None:
        with self._lock:
            self._blocks.pop(source, None)
            self.block_size.pop(source, None)

    def lookup(self, token_ids: list[int], sources: Iterable[str] | None = None) -> dict[str, int]:
        """Source -> tokens of the prompt's prefix it holds (whole blocks); sources with none omitted."""
        wanted = set(sources) if sources is not None else None
        out: dict[str, int] = {}
        with self._lock:
            by_size: dict[int, list[str]] = {}
            for src, bs in self.block_size.items():
                if wanted is None or src in wanted:
                    by_size.setdefault(bs, []).append(src)
            for bs, srcs in by_size.items():
                pk = prompt_keys(token_ids, bs, impl=self._impl)
                if not pk:
                    continue
                for src in srcs:
                    blocks = self._blocks.get(src)
                    n = blocks.held(pk) if blocks is not None else 0
                    if n:
                        out[src] = n * bs
        return out

    def sources(self) -> dict[str, int]:
        """Source -> blocks indexed."""
        with self._lock:
            return {s: len(b) for s, b in self._blocks.items()}
