"""Exact index of which engine holds which KV blocks, fed by KV cache events.

Keys are the router's own chained hashes of block *content* (parent key + token ids), built from
the token ids every BlockStored carries. The engines' hashes are used only to follow parents and
to apply removals. So the index never needs the engine's hash function or its seed
(PYTHONHASHSEED), and one lookup over the prompt's token ids serves vLLM and SGLang alike.

A "source" is one event stream (one engine, one DP rank). Blocks whose parent the index never saw
(events lost before a resync) cannot be keyed and are counted as orphans: the index may miss
blocks, but it never claims a block an engine does not have.
"""

from __future__ import annotations

import threading
from typing import Iterable

from pdsdk.router.kvwire import Cleared, Removed, Stored

ROOT = 0


def _root(lora_id) -> int:
    return ROOT if lora_id is None else hash(("lora", lora_id))


def prompt_keys(token_ids: list[int], block_size: int, lora_id=None) -> list[int]:
    """Chained content keys of the prompt's full blocks (engines only hash full blocks)."""
    keys, h = [], _root(lora_id)
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[i:i + block_size])))
        keys.append(h)
    return keys


class KVIndex:
    def __init__(self, mediums: Iterable[str | None] = (None, "GPU")):
        self.mediums = set(mediums)
        self._lock = threading.Lock()
        self._holders: dict[int, set[str]] = {}  # content key -> sources holding it
        self._blocks: dict[str, dict] = {}  # source -> {engine hash: content key}
        self.block_size: dict[str, int] = {}
        self.counts = dict.fromkeys(("stored", "removed", "cleared", "orphans", "ignored"), 0)

    def apply(self, source: str, events: list) -> int:
        """Apply one batch of decoded events from `source`; returns block events applied."""
        n = 0
        with self._lock:
            blocks = self._blocks.setdefault(source, {})
            for ev in events:
                if isinstance(ev, Stored):
                    n += self._store(source, blocks, ev)
                elif isinstance(ev, Removed):
                    n += self._remove(source, blocks, ev)
                elif isinstance(ev, Cleared):
                    self._clear(source, blocks)
                    self.counts["cleared"] += 1
        return n

    def _store(self, source: str, blocks: dict, ev: Stored) -> int:
        hashes = ev.block_hashes
        if ev.medium not in self.mediums or ev.group_idx not in (None, 0) or not ev.block_size:
            self.counts["ignored"] += len(hashes)
            return 0
        if ev.parent is None:
            key = _root(ev.lora_id)
        else:
            key = blocks.get(ev.parent)
            if key is None:
                self.counts["orphans"] += len(hashes)
                return 0
        bs, toks, holders = ev.block_size, ev.token_ids, self._holders
        self.block_size[source] = bs
        extra = repr(ev.extra_keys) if ev.extra_keys else None
        if len(toks) < bs * len(hashes):
            self.counts["ignored"] += len(hashes)
            return 0
        for i, h in enumerate(hashes):
            block = tuple(toks[i * bs:(i + 1) * bs])
            key = hash((key, block)) if extra is None else hash((key, block, extra))
            blocks[h] = key
            s = holders.get(key)
            if s is None:
                holders[key] = {source}
            else:
                s.add(source)
        self.counts["stored"] += len(hashes)
        return len(hashes)

    def _remove(self, source: str, blocks: dict, ev: Removed) -> int:
        if ev.medium not in self.mediums or ev.group_idx not in (None, 0):
            return 0
        holders = self._holders
        for h in ev.block_hashes:
            key = blocks.pop(h, None)
            if key is not None:
                s = holders.get(key)
                if s is not None:
                    s.discard(source)
                    if not s:
                        del holders[key]
        self.counts["removed"] += len(ev.block_hashes)
        return len(ev.block_hashes)

    def _clear(self, source: str, blocks: dict) -> None:
        holders = self._holders
        for key in blocks.values():
            s = holders.get(key)
            if s is not None:
                s.discard(source)
                if not s:
                    del holders[key]
        blocks.clear()

    def clear(self, source: str) -> None:
        """Forget everything `source` held (engine restarted, unrecoverable gap, worker removed)."""
        with self._lock:
            self._clear(source, self._blocks.setdefault(source, {}))

    def drop(self, source: str) -> None:
        self.clear(source)
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
                alive: set[str] = set(srcs)
                for i, key in enumerate(prompt_keys(token_ids, bs)):
                    s = self._holders.get(key)
                    alive = alive & s if s else set()
                    if not alive:
                        break
                    for src in alive:
                        out[src] = (i + 1) * bs
        return out

    def sources(self) -> dict[str, int]:
        """Source -> blocks indexed."""
        with self._lock:
            return {s: len(b) for s, b in self._blocks.items()}
