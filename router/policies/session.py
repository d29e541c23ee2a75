"""`session`: requests of one session (L6 hint, header or body field) go to the same worker.

A new session lands by rendezvous hashing over the candidates, so when a worker joins or leaves
only the sessions that must move do; the landing is then remembered (LRU, idle TTL), so a worker
joining later does not steal live sessions. Requests without a session go to the least loaded.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Sequence

from pdsdk.router.policies.base import Choice, Policy, RouteRequest, WorkerView, least_loaded, require


def _score(session: str, url: str) -> int:
    # blake2b, not hash(): stable across router restarts and replicas, so they agree
    return int.from_bytes(hashlib.blake2b(f"{session}\0{url}".encode(), digest_size=8).digest(), "big")


class Session(Policy):
    def __init__(self, name: str = "session", max_sessions: int = 100_000, idle_ttl_s: float = 3600.0):
        super().__init__(name)
        self.max_sessions, self.idle_ttl_s = max_sessions, idle_ttl_s
        self._sticky: OrderedDict[str, tuple[str, float]] = OrderedDict()  # session -> (url, last used)

    def choose(self, candidates: Sequence[WorkerView], req: RouteRequest) -> Choice:
        require(candidates)
        if not req.session:
            return Choice(least_loaded(candidates), "no session: least-load")
        now = time.monotonic()
        by_url = {w.url: w for w in candidates}
        known = self._sticky.get(req.session)
        if known and now - known[1] < self.idle_ttl_s and known[0] in by_url:
            worker, reason = by_url[known[0]], "session sticky"
        else:
            worker = max(candidates, key=lambda w: _score(req.session, w.url))
            reason = "session moved (worker gone)" if known and known[0] not in by_url else "session new"
        self._sticky[req.session] = (worker.url, now)
        self._sticky.move_to_end(req.session)
        while len(self._sticky) > self.max_sessions:
            self._sticky.popitem(last=False)
        return Choice(worker, reason)

    def remove_worker(self, worker: WorkerView) -> None:
        for s in [s for s, (url, _) in self._sticky.items() if url == worker.url]:
            del self._sticky[s]

    def stats(self) -> dict:
        return {"sessions": len(self._sticky)}
