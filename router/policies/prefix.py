"""`prefix`: cache-aware routing on an approximate radix tree of what each worker was sent.

Decision (the rule SGLang's cache_aware router uses, sgl-model-gateway policies/cache_aware.rs):
1. load guard: when loads are imbalanced (max - min > balance_abs AND max > balance_rel * min,
   load = requests in flight), take the least loaded worker, whatever the cache says;
2. else the worker with the longest matching prefix, if it covers more than `cache_threshold`
   of the prompt;
3. else the least loaded worker (ties: the smallest tree, so new prefixes spread out).
"""

from __future__ import annotations

from typing import Sequence

from pdsdk.errors import ConfigError
from pdsdk.router.policies.base import Choice, Policy, RouteRequest, WorkerView, require
from pdsdk.router.policies.prefix_tree import PrefixTree, chunk_keys


class Prefix(Policy):
    def __init__(self, name: str = "prefix", cache_threshold: float = 0.3, balance_abs: int = 64,
                 balance_rel: float = 1.5, chunk_chars: int = 64, chunk_tokens: int = 16,
                 max_bytes: int = 64 << 20):
        super().__init__(name)
        if not isinstance(max_bytes, int) or max_bytes < PrefixTree.ENTRY_BYTES:
            raise ConfigError("policy-option", f"{name}.max_bytes must be an integer >= "
                                               f"{PrefixTree.ENTRY_BYTES}")
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.chunk_chars, self.chunk_tokens = chunk_chars, chunk_tokens
        self.tree = PrefixTree(max_bytes // PrefixTree.ENTRY_BYTES)  # one cap over every worker's chunks

    def _keys(self, req: RouteRequest) -> list[int]:
        keys = req.extra.get("_prefix_keys")
        if keys is None:  # cached on the request: prefill and decode pools ask for the same one
            keys = req.extra["_prefix_keys"] = chunk_keys(req.text, req.token_ids, self.chunk_chars,
                                                          self.chunk_tokens)
        return keys

    def choose(self, candidates: Sequence[WorkerView], req: RouteRequest) -> Choice:
        require(candidates)
        keys = self._keys(req)
        loads = [w.load for w in candidates]
        lo, hi = min(loads), max(loads)
        least = min(candidates, key=lambda w: (w.load, self.tree.size(w.url)))
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            choice = Choice(least, f"load guard ({hi}/{lo} in flight)")
        else:
            depth = self.tree.match(keys, {w.url for w in candidates}) if keys else {}
            best = max(candidates, key=lambda w: (depth.get(w.url, 0), -w.load)) if depth else None
            got = depth.get(best.url, 0) if best is not None else 0
            if best is not None and got / len(keys) > self.cache_threshold:
                choice = Choice(best, f"prefix-hit {got}/{len(keys)} chunks", self._tokens(got, req))
            else:
                choice = Choice(least, f"prefix-miss ({got}/{len(keys)} chunks): least-load",
                                self._tokens(depth.get(least.url, 0), req))
        self.tree.insert(choice.worker.url, keys)
        return choice

    def _tokens(self, chunks: int, req: RouteRequest) -> int:
        if req.token_ids is not None:
            return min(chunks * self.chunk_tokens, len(req.token_ids))
        return min(chunks * self.chunk_chars, len(req.text)) // 4

    def cached_tokens(self, worker: WorkerView, req: RouteRequest) -> int:
        keys = self._keys(req)
        return self._tokens(self.tree.match(keys, {worker.url}).get(worker.url, 0), req) if keys else 0

    def remove_worker(self, worker: WorkerView) -> None:
        self.tree.remove_worker(worker.url)

    def stats(self) -> dict:
        return {"tree_chunks": self.tree.sizes(), "tree_bytes": len(self.tree) * PrefixTree.ENTRY_BYTES}
