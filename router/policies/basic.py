"""Cache-blind policies: round_robin, random, least_load, power_of_two."""

from __future__ import annotations

import itertools
import random
from typing import Sequence

from pdsdk.router.policies.base import Choice, Policy, RouteRequest, WorkerView, require


class RoundRobin(Policy):
    """Each candidate in turn (a shared counter, so skipping unhealthy workers stays fair)."""

    def __init__(self, name: str = "round_robin"):
        super().__init__(name)
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[WorkerView], req: RouteRequest) -> Choice:
        require(candidates)
        return Choice(candidates[next(self._counter) % len(candidates)], "round-robin")


class Random(Policy):
    """Uniform random; `seed` makes runs repeatable."""

    def __init__(self, name: str = "random", seed: int | None = None):
        super().__init__(name)
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[WorkerView], req: RouteRequest) -> Choice:
        require(candidates)
        return Choice(self._rng.choice(candidates), "random")


class LeastLoad(Policy):
    """Fewest requests in flight through this router; ties go round-robin, not to the first."""

    def __init__(self, name: str = "least_load"):
        super().__init__(name)
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[WorkerView], req: RouteRequest) -> Choice:
        require(candidates)
        low = min(w.load for w in candidates)
        best = [w for w in candidates if w.load == low]
        return Choice(best[next(self._counter) % len(best)], f"least-load ({low} in flight)")


class PowerOfTwo(Policy):
    """Two random candidates, the less loaded one: near least-load balance without a full scan."""

    def __init__(self, name: str = "power_of_two", seed: int | None = None):
        super().__init__(name)
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[WorkerView], req: RouteRequest) -> Choice:
        require(candidates)
        if len(candidates) == 1:
            return Choice(candidates[0], "only candidate")
        a, b = self._rng.sample(range(len(candidates)), 2)
        w = candidates[a] if candidates[a].load <= candidates[b].load else candidates[b]
        return Choice(w, f"power-of-two ({w.load} in flight)")
