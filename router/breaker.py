"""A worker's circuit breaker: failures in a row take it out of rotation for a cooldown."""

from __future__ import annotations

import time
from typing import Callable

STATES = ("closed", "half-open", "open")  # in rising order of trouble


class CircuitBreaker:
    """closed -> (threshold consecutive failures) -> open for cooldown -> half-open: one trial
    request; its success closes the breaker, its failure reopens it with a doubled cooldown."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0, max_cooldown_s: float = 60.0,
                 on_change: Callable[[str], None] | None = None):
        self.threshold, self.base_cooldown, self.max_cooldown = threshold, cooldown_s, max_cooldown_s
        self.failures, self.cooldown, self.opened_at = 0, cooldown_s, 0.0
        self._state = "closed"
        self._trial = False
        self.on_change = on_change  # hears each new state (the router's processes share them)

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        if value != self._state:
            self._state = value
            if self.on_change is not None:
                self.on_change(value)

    def allows(self, now: float | None = None) -> bool:
        if self.state == "closed":
            return True
        now = time.monotonic() if now is None else now
        if self.state == "open" and now - self.opened_at >= self.cooldown:
            self.state, self._trial = "half-open", False
        return self.state == "half-open" and not self._trial

    def started(self) -> None:
        if self.state == "half-open":
            self._trial = True

    def release(self) -> None:
        """The trial request ended without a verdict on this worker (its partner failed)."""
        if self.state == "half-open":
            self._trial = False

    def record(self, ok: bool) -> None:
        if ok:
            self.failures, self.state, self.cooldown = 0, "closed", self.base_cooldown
            return
        self.failures += 1
        if self.state == "half-open":
            self.cooldown = min(self.cooldown * 2, self.max_cooldown)
            self.state, self.opened_at = "open", time.monotonic()
        elif self.state == "closed" and self.failures >= self.threshold:
            self.state, self.opened_at = "open", time.monotonic()
