"""The routing policy contract. A policy picks one worker from candidates the router hands it.

The router owns health, draining, circuit breakers and load counts; a policy only ranks the
candidates it is given (already filtered to healthy, non-draining, closed-breaker workers).
Policies are synchronous and do no network I/O in `choose`: it runs on the request path.
Background work (e.g. consuming KV event streams) starts in `add_worker` and stops in
`remove_worker` / `close`.

A third-party policy is a subclass registered through the `pdsdk_add_policies` hook; it is
constructed as ``Class(name=name, **options)`` and must pass tests/conformance/test_policies.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence


class NoWorker(LookupError):
    """No candidate can take the request (the router answers 503 with Retry-After)."""


class WorkerView(Protocol):
    """What a policy may read about a worker."""

    url: str  # unique id
    role: str  # "prefill", "decode" or "plain"
    kv_events: str | None  # ZMQ endpoint of the engine's KV event stream, if any
    kv_replay: str | None  # its replay endpoint, if any

    @property
    def load(self) -> int:  # requests in flight through this router
        ...


@dataclass
class RouteRequest:
    """What routing knows about a request. `token_ids` is set when the prompt came as token ids
    or the router tokenized it; `text` is always set (prompt text or flattened chat messages)."""

    request_id: str
    model: str | None = None
    text: str = ""
    token_ids: list[int] | None = None
    session: str | None = None
    priority: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens; estimated at 4 characters per token without token ids."""
        return len(self.token_ids) if self.token_ids is not None else max(1, len(self.text) // 4)


@dataclass
class Choice:
    worker: WorkerView
    reason: str  # for logs, metrics and the route-decision hook
    cached_tokens: int = 0  # prompt tokens this worker is believed to hold already


class Policy:
    """Base class. Subclasses implement `choose`; the rest are optional notifications."""

    needs_tokens = False  # True: the router tries to give `choose` token ids (tokenize via a worker)

    def __init__(self, name: str = "", **options: Any):
        if options:
            raise TypeError(f"policy {name or type(self).__name__}: unknown options {sorted(options)}")
        self.name = name or type(self).__name__

    def choose(self, candidates: Sequence[WorkerView], req: RouteRequest) -> Choice:
        raise NotImplementedError

    def cached_tokens(self, worker: WorkerView, req: RouteRequest) -> int:
        """Prompt tokens `worker` likely holds (conditional disaggregation asks this)."""
        return 0

    def on_start(self, worker: WorkerView, req: RouteRequest) -> None:
        """The request was sent to `worker` (after `choose`, or pinned there by the router)."""

    def on_finish(self, worker: WorkerView, req: RouteRequest, ok: bool) -> None:
        """The request on `worker` ended; ok=False when it failed."""

    def add_worker(self, worker: WorkerView) -> None:
        """A worker joined the pool."""

    def remove_worker(self, worker: WorkerView) -> None:
        """A worker left the pool: forget everything about it."""

    def stats(self) -> dict[str, Any]:
        """Policy-specific state for /admin/workers and debugging (JSON-serializable)."""
        return {}

    def close(self) -> None:
        """Stop background work."""


def require(candidates: Sequence[WorkerView]) -> None:
    if not candidates:
        raise NoWorker("no healthy worker")


def least_loaded(candidates: Sequence[WorkerView]) -> WorkerView:
    return min(candidates, key=lambda w: w.load)


def build_policy(name: str, options: dict[str, Any] | None = None) -> Policy:
    """Instantiate a registered policy by name (built-in or plugin)."""
    from pdsdk.plugins import registry

    cls = registry().load("policy", name)
    return cls(name=name, **(options or {}))
