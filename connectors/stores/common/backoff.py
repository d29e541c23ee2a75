"""Reconnect pacing for remote stores."""

from __future__ import annotations

import threading
import time


class Backoff:
    """Reconnect pacing for remote stores: after a failure, calls are answered locally (misses)
    until the next attempt is due, so an outage costs the engine microseconds, not timeouts."""

    def __init__(self, first_s: float = 0.2, max_s: float = 5.0):
        self.first_s, self.max_s = first_s, max_s
        self._delay = 0.0
        self._next = 0.0
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return self._delay > 0

    def ready(self) -> bool:
        """True when a call may go to the backend (up, or a retry is due)."""
        return self._delay == 0 or time.monotonic() >= self._next

    def failed(self) -> None:
        with self._lock:
            self._delay = min(self.max_s, self._delay * 2 or self.first_s)
            self._next = time.monotonic() + self._delay

    def succeeded(self) -> None:
        self._delay = 0.0
