"""An approximate radix tree of what each worker has seen: a trie over fixed-size chunks of the
prompt (characters of text, or token ids), flattened into one dict keyed by the chained hash of
the chunks so far. A match walks chunk by chunk until no worker holds the next one.

Approximate on purpose (like SGLang's cache_aware router): it records what the router sent,
not what the engine kept. One LRU over every worker's chunks bounds its memory as a whole
(each chunk holds its workers as bits of an int); leaves are evicted before parents.
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
    ENTRY_BYTES = 300  # the process memory one chunk takes (dict slot, LRU node, key int): 230-295 measured

    def __init__(self, max_chunks: int = 1 << 18):
        self.max_chunks = max_chunks
        self._holders: OrderedDict[int, int] = OrderedDict()  # chunk key -> bits of the workers holding it
        self._bits: dict[str, int] = {}  # worker url -> its bit
        self._sizes: dict[int, int] = {}  # bit -> chunks held

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, keys: list[int], among: set[str] | None = None) -> dict[str, int]:
        """Worker -> number of leading chunks it holds (only workers holding at least one)."""
        alive = -1 if among is None else self._mask(among)
        depth: dict[int, int] = {}  # bit -> depth
        for i, k in enumerate(keys):
            nxt = self._holders.get(k, 0) & alive
            if not nxt:
                break
            depth[nxt] = i + 1  # every bit of nxt reached this depth
            alive = nxt
        out: dict[str, int] = {}
        for url, bit in self._bits.items():
            for mask, d in depth.items():  # a few masks, each a subset of the one before
                if mask & bit and d > out.get(url, 0):
                    out[url] = d
        return out

    def insert(self, url: str, keys: list[int]) -> None:
        bit = self._bit(url)
        holders, added = self._holders, 0
        for k in reversed(keys):  # parents end up most recent, so leaves go first
            m = holders.get(k, 0)
            if not m & bit:
                holders[k] = m | bit
                added += 1
            holders.move_to_end(k)
        self._sizes[bit] += added
        while len(holders) > self.max_chunks:
            self._forget(holders.popitem(last=False)[1])

    def _forget(self, mask: int) -> None:
        while mask:
            low = mask & -mask
            self._sizes[low] -= 1
            mask ^= low

    def _bit(self, url: str) -> int:
        bit = self._bits.get(url)
        if bit is None:
            used = 0
            for b in self._bits.values():
                used |= b
            bit = (used + 1) & ~used  # the lowest free bit
            self._bits[url], self._sizes[bit] = bit, 0
        return bit

    def _mask(self, urls: set[str]) -> int:
        mask = 0
        for url in urls:
            mask |= self._bits.get(url, 0)
        return mask

    def remove_worker(self, url: str) -> None:
        bit = self._bits.pop(url, None)
        if bit is None:
            return
        del self._sizes[bit]
        holders = self._holders
        for k in [k for k, m in holders.items() if m & bit]:
            m = holders[k] & ~bit
            if m:
                holders[k] = m
            else:
                del holders[k]

    def size(self, url: str) -> int:
        bit = self._bits.get(url)
        return self._sizes[bit] if bit is not None else 0

    def sizes(self) -> dict[str, int]:
        return {url: self._sizes[bit] for url, bit in self._bits.items()}
