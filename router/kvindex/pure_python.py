"""What _kvindex.c offers, in Python: the KV index's block keys and one source's blocks,
for pdsdk installed without a C compiler (a fraction of the speed). The C file documents both;
the keys differ from the compiled ones (tuple hashes), which is fine: keys never leave the
process, and one process uses one implementation."""

from __future__ import annotations

from itertools import islice, takewhile

from pdsdk.router.kvindex.wire import as_ints


def chain(key: int, tokens, block_size: int, n: int) -> list[int] | None:
    """Keys of the first n blocks of `tokens` after `key`, as tuple hashes; None when too few."""
    if block_size < 1 or n < 0:
        raise ValueError("block_size must be >= 1 and n >= 0")
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


class Blocks:
    """One source's blocks: {engine hash: content key} and how many blocks hold each key."""

    __slots__ = ("_key", "_held")

    def __init__(self):
        self._key: dict = {}  # engine hash -> content key
        self._held: dict[int, int] = {}  # content key -> blocks with that key

    def store(self, base: int, hashes: list, tokens, block_size: int) -> bool:
        if not all(isinstance(h, (int, bytes)) for h in hashes):
            raise TypeError("block_hashes: a hash is neither an int nor bytes")
        keys = chain(base, tokens, block_size, len(hashes))
        if keys is None:
            return False
        held = self._held
        for h, k in zip(hashes, keys):
            old = self._key.get(h)
            if old == k:
                continue  # stored again (a replay): nothing changes
            if old is not None:
                self._unhold(old)
            self._key[h] = k
            held[k] = held.get(k, 0) + 1
        return True

    def key(self, h) -> int | None:
        return self._key.get(h) if isinstance(h, (int, bytes)) else None

    def remove(self, hashes: list) -> int:
        gone = 0
        for h in hashes:
            k = self._key.pop(h, None) if isinstance(h, (int, bytes)) else None
            if k is not None:
                self._unhold(k)
                gone += 1
        return gone

    def held(self, keys: list[int]) -> int:
        return sum(1 for _ in takewhile(self._held.__contains__, keys))

    def clear(self) -> None:
        self._key.clear()
        self._held.clear()

    def __len__(self) -> int:
        return len(self._key)

    def _unhold(self, k: int) -> None:
        if self._held[k] == 1:
            del self._held[k]
        else:
            self._held[k] -= 1
