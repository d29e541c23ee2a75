"""Router settings (the `pdsdk router` options map one to one onto these fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdsdk.errors import ConfigError

ENGINES = ("vllm", "sglang")
MAX_PROCESSES = 64


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    listen_fd: int | None = None  # a listening socket inherited from `pdsdk launch`, kept across router restarts
    processes: int = 1  # serving processes on the one port (processes/); 1: this process serves
    engine: str = "vllm"
    workers: list[str] = field(default_factory=list)  # plain mode
    prefill: list[str] = field(default_factory=list)  # PD mode; SGLang: "URL [BOOTSTRAP_PORT]"
    decode: list[str] = field(default_factory=list)
    policy: str = "least_load"
    prefill_policy: str | None = None  # default: `policy`
    decode_policy: str | None = None
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # policy name -> options
    kv_events: dict[str, str] = field(default_factory=dict)  # worker URL -> ZMQ endpoint(s)
    kv_replay: dict[str, str] = field(default_factory=dict)  # worker URL -> replay endpoint(s)
    models: list[str] = field(default_factory=list)  # served model names; default: asked from workers
    api_key: str | None = None
    admin_key: str | None = None
    worker_api_key: str | None = None  # sent to workers as "Authorization: Bearer ..."
    max_body_bytes: int = 32 << 20
    max_connections: int = 4096  # client connections open at once (lowered to fit the open-files limit)
    max_client_connections: int = 1024  # of them from one client address
    read_timeout_s: float = 15.0  # for a request head to arrive whole, and for each wait on its body
    retries: int = 2  # extra attempts on a new worker/pair, only before the first token
    connect_timeout_s: float = 5.0
    first_token_timeout_s: float = 120.0  # a worker silent this long counts as failed (then retry)
    request_timeout_s: float = 1800.0  # deadline for a whole request, stream included
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    health_failures: int = 3  # slow/non-200 checks in a row before a worker is out (a refused connection: at once)
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    disagg_threshold: int = 0  # uncached prompt tokens below this: decode worker alone (vLLM); 0: off
    tokenize: str = "auto"  # kv_events token ids: "worker" (POST /tokenize), "auto" (so, until a 404), "none"
    retry_after_s: int = 1
    etcd: str | None = None  # http://host:2379 (v3 JSON gateway)
    etcd_prefix: str = "/pdsdk/workers/"

    @property
    def pd(self) -> bool:
        return bool(self.prefill or self.decode)

    def policy_for(self, role: str) -> str:
        if role == "prefill":
            return self.prefill_policy or self.policy
        if role == "decode":
            return self.decode_policy or self.policy
        return self.policy

    def describe(self) -> str:
        roles = ("prefill", "decode") if self.pd else ("plain",)
        return f"{'PD' if self.pd else 'plain'}, {self.engine}, policies " + \
            ", ".join(f"{r}={self.policy_for(r)}" for r in roles)

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError("engine", f"{self.engine!r} is not one of {', '.join(ENGINES)}")
        if self.workers and self.pd:
            raise ConfigError("worker", "give either --worker (plain mode) or --prefill/--decode (PD mode)")
        if self.tokenize not in ("auto", "worker", "none"):
            raise ConfigError("tokenize", f"{self.tokenize!r} is not one of auto, worker, none")
        if self.retries < 0 or self.max_body_bytes <= 0:
            raise ConfigError("retries", "retries must be >= 0 and the body limit > 0")
        if self.max_connections < 1 or self.max_client_connections < 1:
            raise ConfigError("max-connections", "the connection limits must be >= 1")
        key = self.worker_api_key
        if key is not None and (not key.isascii() or not key.isprintable()):
            raise ConfigError("worker-api-key", "must be printable ASCII: it is sent in an HTTP header")
        if not 0 < self.read_timeout_s < float("inf"):
            raise ConfigError("read-timeout", f"seconds must be a positive number, not {self.read_timeout_s}")
        if not 1 <= self.processes <= MAX_PROCESSES:
            raise ConfigError("processes", f"must be 1 to {MAX_PROCESSES}, not {self.processes}")
        if self.health_failures < 1:
            raise ConfigError("health-failures", f"must be >= 1, not {self.health_failures}")

    @property
    def tokenize_via_worker(self) -> bool:
        # vLLM and SGLang (0.5.15 on) serve POST /tokenize with the model's own tokenizer and chat template
        return self.tokenize != "none"
