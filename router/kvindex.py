"""Exact index of which engine holds which KV blocks, fed by KV cache events.

Keys are the router's own chained keys of block *content*, built from the token ids every
BlockStored carries. The engines' hashes are used only to follow parents and to apply removals.
So the index never needs the engine's hash function or its seed (PYTHONHASHSEED), and one
lookup over the prompt's token ids serves vLLM and SGLang alike.

The key of a block is hash((parent's key, its tokens)), from a root key per LoRA adapter (an
event's extra keys are hashed into the chain first): it depends on every token of the prefix and
on their order, and a child's key follows from its parent's key alone. One tuple hash per block:
`apply` runs 1.5M blocks per CPU-second against 1.0M for the position-aware XOR scheme it
replaced, whose keys were integers above 2**64 that cost an allocation at every step.

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

from pdsdk.router.kvwire import CLEARED, REMOVED, STORED

ROOT = 0


def _root(lora_id) -> int:
    return ROOT if lora_id is None else hash(("lora", lora_id))


def _chain(key: int, tokens: list[int], block_size: int, n: int, extra=None) -> list[int]:
    """Keys of the n full blocks of `tokens` that follow the block keyed `key`. Extra keys (a
    multimodal input's hash, ...) enter the chain once, before the first block: every key from
    there on differs from a plain prompt's."""
    if extra is not None:
        key = hash((key, extra))
    it = iter(tokens)
    out: list[int] = []
    add = out.append
    for block in islice(zip(*([it] * block_size)), n):
        key = hash((key, block))
        add(key)
    return out


def prompt_keys(token_ids: list[int], block_size: int, lora_id=None) -> list[int]:
    """Chained content keys of the prompt's full blocks (engines only hash full blocks)."""
    return _chain(_root(lora_id), token_ids, block_size, len(token_ids) // block_size)


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
                    toks = ev.token_ids
                    if len(toks) < bs * m:
                        ignored += m
                        continue
                    extra = ev.extra_keys
                    if m == 1 and not extra:  # one block (a decode step): _chain's result, without the call
                        key = hash((base, tuple(toks[:bs])))
                        blocks[hashes[0]] = key
                        keys.add(key)
                        stored += 1
                        self.block_size[source] = bs
                        continue
                    new = _chain(base, toks, bs, m, repr(extra) if extra else None)
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
