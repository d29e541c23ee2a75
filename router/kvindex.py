"""Exact index of which engine holds which KV blocks, fed by KV cache events.

Keys are the router's own chained keys of block *content*, built from the token ids every
BlockStored carries. The engines' hashes are used only to follow parents and to apply removals.
So the index never needs the engine's hash function or its seed (PYTHONHASHSEED), and one
lookup over the prompt's token ids serves vLLM and SGLang alike.

A block's key mixes its parent's key with its token ids, from a root key per LoRA adapter (an
event's extra keys are hashed into the chain first): it depends on every token of the prefix and
on their order, and a child's key follows from its parent's key alone. The compiled hasher
(router/_kvhash.c) reads an event's token ids straight from its msgpack bytes: no Python int per
token, which held the index at 0.5-0.8M block events/s; with it, 1.1M+ on 2 shared cores. Without a
C compiler at install time, keys are tuple hashes in Python (about half the speed). Keys never
leave the process, so the two kinds never meet.

A "source" is one event stream (one engine, one DP rank). Per source the index keeps
{engine hash: content key} and the set of content keys held; updates are dict.update /
set.update over whole events. Blocks whose parent the index never saw (events lost before a
resync) cannot be keyed and are counted as orphans: the index may miss blocks, but it never
claims a block an engine does not have.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from itertools import islice, repeat, takewhile

from pdsdk.router.kvwire import CLEARED, REMOVED, STORED, WireError, as_ints

try:
    from pdsdk.router._kvhash import chain as _compiled_chain
except ImportError:  # installed without a C compiler
    _compiled_chain = None

ROOT = 0


def _root(lora_id) -> int:
    return ROOT if lora_id is None else hash(("lora", lora_id))


def _python_chain(key: int, tokens, block_size: int, n: int) -> list[int] | None:
    toks = as_ints(tokens)
    if len(toks) < block_size * n:
        return None
    it = iter(toks)
    out: list[int] = []
    add = out.append
    for block in islice(zip(*([it] * block_size)), n):
        key = hash((key, block))
        add(key)
    return out


def chain(key: int, tokens, block_size: int, n: int, extra=None) -> list[int] | None:
    """Keys of the n full blocks of `tokens` (a list of ints, or an event's msgpack token ids)
    that follow the block keyed `key`; None when there are fewer than block_size * n tokens.
    Extra keys (a multimodal input's hash, ...) enter the chain once, before the first block:
    every key from there on differs from a plain prompt's."""
    if extra is not None:
        key = hash((key, extra))
    if _compiled_chain is not None:
        try:
            return _compiled_chain(key, tokens, block_size, n)
        except (TypeError, ValueError, OverflowError) as e:  # token ids that are not ints
            raise WireError(f"token_ids: {e}") from None
    return _python_chain(key, tokens, block_size, n)


def prompt_keys(token_ids: list[int], block_size: int, lora_id=None) -> list[int]:
    """Chained content keys of the prompt's full blocks (engines only hash full blocks); none for
    a prompt whose ids are not ints (no engine can hold it)."""
    try:
        return chain(_root(lora_id), token_ids, block_size, len(token_ids) // block_size) or []
    except WireError:
        return []


class KVIndex:
    def __init__(self, mediums: Iterable[str | None] = (None, "GPU")):
        self.mediums = frozenset(mediums)
        self._lock = threading.Lock()
        self._blocks: dict[str, dict] = {}  # source -> {engine hash: content key}
        self._keys: dict[str, set[int]] = {}  # source -> content keys it holds
        self.block_size: dict[str, int] = {}
        self.counts = dict.fromkeys(("stored", "removed", "cleared", "orphans", "ignored"), 0)

    def apply(self, source: str, events: list) -> int:
        """Apply one batch of decoded events from `source`; returns block events applied.
        The per-event work is inlined here: at one block per event (vLLM decode steps) the
        per-event overhead is a large part of the cost."""
        stored = removed = ignored = orphans = cleared = 0
        mediums = self.mediums
        with self._lock:
            blocks = self._blocks.get(source)
            if blocks is None:
                blocks = self._blocks[source] = {}
                self._keys[source] = set()
            keys = self._keys[source]
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
                        base = ROOT if ev.lora_id is None else _root(ev.lora_id)
                    else:
                        base = blocks.get(parent)
                        if base is None:
                            orphans += m
                            continue
                    extra = ev.extra_keys
                    try:
                        new = chain(base, ev.token_ids, bs, m, repr(extra) if extra else None)
                    except WireError:
                        new = None
                    if new is None:  # fewer token ids than blocks, or ids that are not ints
                        ignored += m
                        continue
                    blocks.update(zip(hashes, new))
                    keys.update(new)
                    stored += m
                    self.block_size[source] = bs
                elif kind == REMOVED:
                    if ev.medium not in mediums or ev.group_idx not in (None, 0):
                        continue
                    hashes = ev.block_hashes
                    keys.difference_update(map(blocks.pop, hashes, repeat(None)))  # unknown hashes pop None
                    removed += len(hashes)
                elif kind == CLEARED:
                    blocks.clear()
                    keys.clear()
                    cleared += 1
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
                self._keys[source].clear()
            else:
                self._blocks[source], self._keys[source] = {}, set()

    def drop(self, source: str) -> None:
        with self._lock:
            self._blocks.pop(source, None)
            self._keys.pop(source, None)
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
                pk = prompt_keys(token_ids, bs)
                for src in srcs:
                    held = self._keys.get(src)
                    if held and pk and pk[0] in held:
                        n = len(list(takewhile(held.__contains__, pk)))
                        out[src] = n * bs
        return out

    def sources(self) -> dict[str, int]:
        """Source -> blocks indexed."""
        with self._lock:
            return {s: len(b) for s, b in self._blocks.items()}
