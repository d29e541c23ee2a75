"""`kv_events`: route on an exact index of the engines' KV blocks, fed by their ZMQ event streams.

Each worker registered with a `kv_events` endpoint (and ideally its `kv_replay` endpoint) gets
an EventStream thread. Decision: the load guard first (as `prefix`), then the worker holding
the longest prefix of the prompt's blocks (ties: least loaded), else the least loaded.
Matching needs token ids; a request without them (text prompt and no tokenizer) is routed by
the approximate `prefix` policy instead, and the reason says so ("degraded").
"""

from __future__ import annotations

from typing import Sequence

from pdsdk.router.kvindex import KVIndex
from pdsdk.router.kvindex.stream import EventStream
from pdsdk.router.policies.base import Choice, Policy, RouteRequest, WorkerView, require
from pdsdk.router.policies.prefix import Prefix


class KVEvents(Policy):
    needs_tokens = True

    def __init__(self, name: str = "kv_events", balance_abs: int = 64, balance_rel: float = 1.5,
                 replay_timeout_s: float = 2.0, topic: str = "", mediums: Sequence[str | None] = (None, "GPU")):
        super().__init__(name)
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.replay_timeout_s, self.topic = replay_timeout_s, topic.encode()
        self.index = KVIndex(mediums)
        self.streams: dict[str, list[EventStream]] = {}  # worker url -> its streams (one per DP rank)
        self._fallback = Prefix(name="prefix", balance_abs=balance_abs, balance_rel=balance_rel)

    # --- workers --------------------------------------------------------------------------
    def add_worker(self, worker: WorkerView) -> None:
        if worker.url in self.streams or not worker.kv_events:
            return
        eps = [e.strip() for e in worker.kv_events.split(",") if e.strip()]
        replays = [e.strip() for e in (worker.kv_replay or "").split(",")]
        streams = []
        for i, ep in enumerate(eps):
            rep = replays[i] if i < len(replays) and replays[i] else None
            s = EventStream(f"{worker.url}@{ep}", ep, self.index, rep, self.topic, self.replay_timeout_s)
            s.start()
            streams.append(s)
        self.streams[worker.url] = streams

    def remove_worker(self, worker: WorkerView) -> None:
        for s in self.streams.pop(worker.url, []):
            s.stop()
            self.index.drop(s.source)
        self._fallback.remove_worker(worker)

    def close(self) -> None:
        for streams in self.streams.values():
            for s in streams:
                s.stop()
        for streams in self.streams.values():
            for s in streams:
                s.join(2)

    # --- routing --------------------------------------------------------------------------
    def _hits(self, req: RouteRequest) -> dict[str, int]:
        """Worker url -> cached prompt tokens, computed once per request and index."""
        cache = req.extra.setdefault("_kv_hits", {})
        hits = cache.get(id(self.index))
        if hits is None:
            by_source = self.index.lookup(req.token_ids) if req.token_ids else {}
            hits = {}
            for url, streams in self.streams.items():
                best = max((by_source.get(s.source, 0) for s in streams), default=0)
                if best:
                    hits[url] = best
            cache[id(self.index)] = hits
        return hits

    def choose(self, candidates: Sequence[WorkerView], req: RouteRequest) -> Choice:
        require(candidates)
        if req.token_ids is None:
            c = self._fallback.choose(candidates, req)
            return Choice(c.worker, f"degraded (no token ids): {c.reason}", c.cached_tokens)
        loads = [w.load for w in candidates]
        lo, hi = min(loads), max(loads)
        least = min(candidates, key=lambda w: w.load)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return Choice(least, f"load guard ({hi}/{lo} in flight)", self._hits(req).get(least.url, 0))
        hits = self._hits(req)
        best = max(candidates, key=lambda w: (hits.get(w.url, 0), -w.load))
        got = hits.get(best.url, 0)
        if got:
            return Choice(best, f"kv-hit {got}/{len(req.token_ids)} tokens", got)
        return Choice(least, "kv-miss: least-load", 0)

    def cached_tokens(self, worker: WorkerView, req: RouteRequest) -> int:
        if req.token_ids is None:
            return self._fallback.cached_tokens(worker, req)
        return self._hits(req).get(worker.url, 0)

    def stats(self) -> dict:
        return {"index": dict(self.index.counts), "blocks": self.index.sources(),
                "streams": {s.source: s.stats() for ss in self.streams.values() for s in ss}}
