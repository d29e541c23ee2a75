"""An approximate radix tree of what each worker has seen: a trie over fixed-size chunks of the
prompt (characters of text, or token ids), flattened into one dict keyed by the chained hash of
the chunks so far. A match walks chunk by chunk until no worker holds the next one.

Approximate on purpose (like SGLang's cache_aware router): it records what the router sent,
not what the engine kept. Per-worker LRU bounds its size; leaves are evicted before parents.
"""

from __future__ import annotations

from collections import OrderedDict

TEXT_ROOT, TOKEN_ROOT = 1, 2  # distinct roots: text and token chains never match each other


def chunk_keys(text: str, token_ids: list[int] | None, chunk_chars: int, chunk_tokens: int) -> list[int]:
    """Chained chunk hashes of a prompt; token ids win when present. The last chunk may be short."""
    keys: list[int] = []
    if token_ids is not None:
        h = TOKEN_ROOT
        for i in range(0, len(token_ids), chunk_tokens):
            h = hash((h, tuple(token_ids[i:i + chunk_tokens])))
            keys.append(h)
    else:
        h = TEXT_ROOT
        for i in range(0, len(text), chunk_chars):
            h = hash((h, text[i:i + chunk_chars]))
            keys.append(h)
    return keys


class PrefixTree:
    def __init__(self, max_chunks_per_worker: int = 1 << 20):
        self.max_chunks = max_chunks_per_worker
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def match(self, keys: list[int], among: set[str] | None = None) -> dict[str, int]:
        """Worker -> number of leading chunks it holds (only workers holding at least one)."""
        depth: dict[str, int] = {}
        alive: set[str] | None = None
        for i, k in enumerate(keys):
            holders = self._holders.get(k)
            if not holders:
                break
            nxt = set(holders) if alive is None else alive & holders
            if among is not None and alive is None:
                nxt &= among
            if not nxt:
                break
            for url in nxt:
                depth[url] = i + 1
            alive = nxt
        return depth

    def insert(self, url: str, keys: list[int]) -> None:
        lru = self._lru.setdefault(url, OrderedDict())
        for k in reversed(keys):  # parents end up most recent, so leaves go first
            self._holders.setdefault(k, set()).add(url)
            lru[k] = None
            lru.move_to_end(k)
        while len(lru) > self.max_chunks:
            self._drop(url, lru.popitem(last=False)[0])

    def _drop(self, url: str, key: int) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(url)
            if not holders:
                del self._holders[key]

    def remove_worker(self, url: str) -> None:
        for k in self._lru.pop(url, ()):
            self._drop(url, k)

    def size(self, url: str) -> int:
        return len(self._lru.get(url, ()))
