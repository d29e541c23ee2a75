"""Workers and the pool: health, draining and in-flight counts (each with its circuit breaker).

The pool decides which workers are candidates; policies only rank candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

from pdsdk.errors import ConfigError
from pdsdk.router.breaker import CircuitBreaker

if TYPE_CHECKING:
    from pdsdk.router.processes.load_table import LoadTable

ROLES = ("plain", "prefill", "decode")


@dataclass(eq=False)
class Worker:
    url: str
    role: str = "plain"
    bootstrap_port: int | None = None  # SGLang prefill: its --disaggregation-bootstrap-port
    kv_events: str | None = None
    kv_replay: str | None = None
    source: str = "static"  # static | admin | etcd
    healthy: bool = True
    health_failures: int = 0  # failed health checks in a row
    draining: bool = False
    models: list[str] = field(default_factory=list)
    inflight: int = 0  # requests in flight from this process
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    last_error: str | None = None
    table: LoadTable | None = field(default=None, repr=False)  # shared by `router --processes N`
    slot: int = -1  # the worker's column in `table`

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise ConfigError("url", f"must be a string like http://10.0.0.5:8000, "
                                     f"not {type(self.url).__name__}")
        self.url = self.url.rstrip("/")
        try:
            parts = urlsplit(self.url)
            parts.port  # noqa: B018 - raises ValueError for a port out of range
        except ValueError as e:
            raise ConfigError("url", f"{self.url[:200]!r} is not a valid URL ({e})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError("url", f"{self.url[:200]!r} is not an http(s) URL like http://10.0.0.5:8000")
        if self.role not in ROLES:
            raise ConfigError("role", f"{str(self.role)[:40]!r} is not one of {', '.join(ROLES)}")
        p = self.bootstrap_port
        if p is not None and (not isinstance(p, int) or isinstance(p, bool) or not 0 < p < 65536):
            raise ConfigError("bootstrap_port", f"must be a port (1 to 65535) or null, not {str(p)[:40]!r}")
        for name in ("kv_events", "kv_replay"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(name, "must be a string of ZMQ endpoints (comma-separated) or null")

    @property
    def load(self) -> int:
        """Requests in flight to this worker through the whole router (all of its processes)."""
        return self.inflight if self.table is None else self.table.total(self.slot)

    @property
    def breaker_state(self) -> str:
        """Its breaker's state; with several processes, the worst any of them holds."""
        return self.breaker.state if self.table is None else self.table.breaker(self.slot)

    def begin(self) -> None:
        self.inflight += 1
        if self.table is not None:
            self.table.add(self.slot, 1)

    def end(self) -> None:
        self.inflight -= 1
        if self.table is not None:
            self.table.add(self.slot, -1)

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    def usable(self) -> bool:
        return self.healthy and not self.draining and self.breaker.allows()

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "role": self.role, "bootstrap_port": self.bootstrap_port,
                "kv_events": self.kv_events, "kv_replay": self.kv_replay, "source": self.source,
                "healthy": self.healthy, "draining": self.draining, "models": self.models,
                "in_flight": self.load, "breaker": self.breaker_state, "last_error": self.last_error}


def parse_worker_arg(value: str, role: str) -> Worker:
    """CLI form: URL, plus for SGLang prefill an optional bootstrap port after a space or
    comma ("http://p:30000 8998", the sglang router's form; "none" means the engine default)."""
    parts = value.replace(",", " ").split()
    if not parts:
        raise ConfigError(role, "empty worker URL")
    port = None
    if len(parts) > 1 and parts[1].lower() != "none":
        try:
            port = int(parts[1])
        except ValueError:
            raise ConfigError(role, f"bootstrap port {parts[1]!r} is not a number") from None
    return Worker(parts[0], role=role, bootstrap_port=port)


class WorkerPool:
    """All workers by URL. `listeners` hear (event, worker) with event "add" or "remove"."""

    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}
        self.listeners: list[Callable[[str, Worker], None]] = []

    def add(self, worker: Worker) -> Worker:
        old = self.workers.get(worker.url)
        if old is not None:
            if (old.role, old.bootstrap_port, old.kv_events) == (worker.role, worker.bootstrap_port,
                                                                   worker.kv_events):
                old.draining = False
                return old
            self.remove(old.url)
        self.workers[worker.url] = worker
        for fn in self.listeners:
            fn("add", worker)
        return worker

    def remove(self, url: str) -> Worker | None:
        worker = self.workers.pop(url.rstrip("/"), None)
        if worker is not None:
            for fn in self.listeners:
                fn("remove", worker)
        return worker

    def get(self, url: str) -> Worker | None:
        return self.workers.get(url.rstrip("/"))

    def candidates(self, role: str, exclude: set[str] = frozenset(), model: str | None = None) -> list[Worker]:
        return [w for w in self.workers.values()
                if w.role == role and w.url not in exclude and w.usable()
                and (model is None or not w.models or model in w.models)]

    def by_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role]

    def models(self) -> list[str]:
        return sorted({m for w in self.workers.values() for m in w.models})

    def serves(self, model: str) -> bool:
        """Does a worker serve `model`, or has none said which models it serves? (as models() would tell)"""
        said = False
        for w in self.workers.values():
            if model in w.models:
                return True
            said = said or bool(w.models)
        return not said
