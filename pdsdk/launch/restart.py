"""The launcher's restart rules: when a process that served is started again, how long it waits
first, and when the launcher gives up (`pdsdk launch --restart/--max-restarts/--unhealthy-timeout`)."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass

from pdsdk.errors import ConfigError
from pdsdk.launch.plan import ProcessSpec

MODES = ("on-failure", "always", "never")
MAX_BACKOFF_S = 60.0
STABLE_S = 600.0  # healthy this long: the restarts-in-a-row count (and the backoff) start again


@dataclass
class RestartPolicy:
    mode: str = "on-failure"  # on-failure: not after a clean exit (code 0); always; never: stop everything
    max_restarts: int = 5  # in a row, per process; one more failure and the launcher gives up
    unhealthy_s: float = 60.0  # a running process failing its health check this long is killed and restarted
    start_timeout_s: float = 900.0  # a restarted process not healthy by then is killed and restarted
    backoff_s: float = 1.0  # wait before the first restart in a row; doubles each time, at most 60 s

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError("--restart", f"{self.mode!r} is not one of {', '.join(MODES)}")
        if self.max_restarts < 0:
            raise ConfigError("--max-restarts", f"must be >= 0, got {self.max_restarts}")
        if self.unhealthy_s <= 0 or self.start_timeout_s <= 0 or self.backoff_s < 0:
            raise ConfigError("--unhealthy-timeout", "the health and start timeouts must be > 0")

    def restarts(self, code: int) -> bool:
        """Whether a process that exited with `code` is started again (give-up aside)."""
        return self.mode == "always" or (self.mode == "on-failure" and code != 0)

    def delay(self, in_a_row: int) -> float:
        return min(self.backoff_s * 2 ** in_a_row, MAX_BACKOFF_S)


class Child:
    """One supervised process: its current Popen, its state and its counters.

    States: starting (not healthy yet), healthy, unhealthy (failing its health check since
    `failing_since`), down (exited; started again at `due`)."""

    def __init__(self, spec: ProcessSpec, proc: subprocess.Popen, color: str):
        self.spec, self.proc, self.color = spec, proc, color
        self.state = "starting"
        self.started = time.monotonic()
        self.restarts = 0  # in all: the counter in status.json
        self.in_a_row = 0
        self.healthy_since: float | None = None
        self.failing_since: float | None = None
        self.due: float | None = None
        self.killed_because: str | None = None  # why the launcher killed it (hung), for its exit line
        self.last_exit: str | None = None

    def healthy(self, now: float) -> None:
        if self.state != "healthy":
            self.healthy_since = now
        self.state, self.failing_since = "healthy", None
        if self.in_a_row and now - (self.healthy_since or now) >= STABLE_S:
            self.in_a_row = 0

    def describe(self) -> dict:
        return {"role": self.spec.role, "port": self.spec.port, "pid": self.proc.pid, "state": self.state,
                "restarts": self.restarts, "last_exit": self.last_exit}


def exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
