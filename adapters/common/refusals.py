"""Messages a peer can send at will and we refuse: counted, logged at most once a minute (a flood must not
flood the log), never echoed back, never a traceback."""

from __future__ import annotations

import logging
import threading
import time

LOG_EVERY_S = 60.0


class Refusals:
    def __init__(self, what: str, log: logging.Logger, every_s: float = LOG_EVERY_S):
        self.what, self.log, self.every_s = what, log, every_s
        self.count = 0
        self._unlogged, self._logged_at = 0, -every_s
        self._lock = threading.Lock()

    def __call__(self, why: str) -> None:
        with self._lock:
            self.count += 1
            self._unlogged += 1
            now = time.monotonic()
            if now - self._logged_at < self.every_s:
                return
            n, self._unlogged, self._logged_at = self._unlogged, 0, now
        self.log.warning("pdsdk: %s refused %d message(s) (latest: %s)", self.what, n, why)
