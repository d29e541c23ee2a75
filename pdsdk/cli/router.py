"""`pdsdk router`: the OpenAI-compatible PD router (router/, docs/router.md)."""

from __future__ import annotations

import argparse
import json
import os

from pdsdk.errors import ConfigError, MissingDependency

EXAMPLES = """examples:
  pdsdk router --worker http://127.0.0.1:8001 --worker http://127.0.0.1:8002 --policy prefix
  pdsdk router --engine vllm --prefill http://p:8100 --decode http://d:8200 --policy kv_events \\
      --kv-events http://p:8100=tcp://p:5557 --kv-replay http://p:8100=tcp://p:5558
  pdsdk router --engine sglang --prefill http://p:30000 8998 --decode http://d:30001
  pdsdk router --engine vllm --etcd http://127.0.0.1:2379 --port 8000   # workers join via etcd
"""


def register(sub) -> None:
    p = sub.add_parser("router", help="OpenAI-compatible router for plain and PD-disaggregated workers",
                       description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it: set keys)")
    a("--port", type=int, default=8000, help="port to listen on (default 8000)")
    a("--listen-fd", type=int, default=None, metavar="FD",
      help="serve on this inherited listening socket instead of binding --host/--port (pdsdk launch passes "
           "its own: connections wait in its backlog while a router restarts)")
    a("--processes", type=int, default=None, metavar="N",
      help="serving processes on the one port, each with the whole request path (default: env "
           "PDSDK_ROUTER_PROCESSES, else the machine's cores up to 8; 1: a single process)")
    a("--engine", choices=("vllm", "sglang"), default="vllm", help="PD protocol the workers speak (default vllm)")
    a("--worker", action="append", default=[], metavar="URL", help="plain-mode worker URL (repeatable)")
    a("--prefill", action="append", nargs="+", default=[], metavar="URL [BOOTSTRAP_PORT]",
      help="PD prefill worker (repeatable); SGLang: optionally its --disaggregation-bootstrap-port")
    a("--decode", action="append", default=[], metavar="URL", help="PD decode worker URL (repeatable)")
    a("--policy", default="least_load", help="routing policy for every pool (`pdsdk plugins` lists them; "
                                             "default least_load)")
    a("--prefill-policy", help="policy for the prefill pool (default: --policy)")
    a("--decode-policy", help="policy for the decode pool (default: --policy)")
    a("--policy-option", action="append", default=[], metavar="POLICY.KEY=VALUE",
      help="option for a policy, VALUE as JSON (e.g. prefix.cache_threshold=0.5); repeatable")
    a("--kv-events", action="append", default=[], metavar="URL=ENDPOINT",
      help="worker's ZMQ KV event endpoint(s), comma-separated per DP rank, for kv_events (repeatable)")
    a("--kv-replay", action="append", default=[], metavar="URL=ENDPOINT",
      help="worker's KV event replay endpoint(s), same order as --kv-events (repeatable)")
    a("--model", action="append", default=[], metavar="NAME",
      help="served model name(s); default: what the workers report on /v1/models")
    a("--api-key", default=os.environ.get("PDSDK_ROUTER_API_KEY"),
      help="key clients must send as 'Authorization: Bearer KEY' (env PDSDK_ROUTER_API_KEY)")
    a("--admin-key", default=os.environ.get("PDSDK_ROUTER_ADMIN_KEY"),
      help="separate key for /admin/* (env PDSDK_ROUTER_ADMIN_KEY); without it admin works on loopback only")
    a("--worker-api-key", default=os.environ.get("PDSDK_WORKER_API_KEY"),
      help="key sent to the workers (their --api-key; env PDSDK_WORKER_API_KEY)")
    a("--max-body-mb", type=float, default=32, help="largest request body accepted, MiB (default 32)")
    a("--max-connections", type=int, default=4096,
      help="client connections open at once; more are answered 503 (default 4096)")
    a("--max-client-connections", type=int, default=1024,
      help="client connections open at once from one address (default 1024)")
    a("--read-timeout", type=float, default=15.0,
      help="seconds for a request head to arrive whole, and that a request body may stall (default 15)")
    a("--retries", type=int, default=2, help="extra attempts on another worker/pair before the first token "
                                             "(default 2)")
    a("--connect-timeout", type=float, default=5.0, help="seconds to connect to a worker (default 5)")
    a("--first-token-timeout", type=float, default=120.0,
      help="seconds a streaming worker (or a vLLM prefill) may stay silent before it counts as failed "
           "(default 120)")
    a("--request-timeout", type=float, default=1800.0,
      help="deadline for a whole request in seconds (default 1800; clients may lower it per request "
           "with the X-Request-Timeout header)")
    a("--health-interval", type=float, default=5.0, help="seconds between health checks (default 5)")
    a("--health-timeout", type=float, default=2.0, help="seconds a health check may take (default 2)")
    a("--health-failures", type=int, default=3,
      help="health checks in a row that time out or fail before a worker is taken out (default 3); "
           "a worker that refuses the connection is out at once")
    a("--breaker-threshold", type=int, default=3,
      help="consecutive failures that open a worker's circuit breaker (default 3)")
    a("--breaker-cooldown", type=float, default=5.0,
      help="seconds an open breaker waits before one trial request (doubles on failure; default 5)")
    a("--disagg-threshold", type=int, default=0,
      help="vLLM PD: prompts with fewer uncached tokens than this run on the decode worker alone "
           "(default 0: always disaggregate)")
    a("--tokenize", choices=("auto", "worker", "none"), default="auto",
      help="how kv_events gets token ids for text prompts: worker = POST /tokenize on a worker (vLLM, "
           "SGLang); auto = worker, until a worker has no /tokenize (default)")
    a("--retry-after", type=int, default=1, help="Retry-After seconds on 503 (default 1)")
    a("--etcd", help="etcd URL (v3 JSON gateway, e.g. http://127.0.0.1:2379): workers register there")
    a("--etcd-prefix", default="/pdsdk/workers/", help="etcd key prefix of worker records "
                                                       "(default /pdsdk/workers/)")
    p.set_defaults(func=run)


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        url, sep, ep = item.partition("=")
        if not sep or not ep:
            raise ConfigError(flag, f"{item!r} must look like URL=ENDPOINT")
        out[url.rstrip("/")] = ep
    return out


def _policy_options(items: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for item in items:
        key, sep, value = item.partition("=")
        name, dot, opt = key.partition(".")
        if not sep or not dot:
            raise ConfigError("policy-option", f"{item!r} must look like POLICY.KEY=VALUE")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out.setdefault(name, {})[opt] = parsed
    return out


def default_processes() -> int:
    """PDSDK_ROUTER_PROCESSES, else the cores this process may use, at most 8."""
    env = os.environ.get("PDSDK_ROUTER_PROCESSES")
    if env is not None:
        try:
            return int(env)
        except ValueError:
            raise ConfigError("PDSDK_ROUTER_PROCESSES", f"{env[:40]!r} is not a whole number") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(8, cores)


def config_from_args(args):
    from pdsdk.router.config import RouterConfig

    return RouterConfig(
        host=args.host, port=args.port, listen_fd=args.listen_fd, engine=args.engine,
        processes=args.processes if args.processes is not None else default_processes(), workers=args.worker,
        prefill=[" ".join(p) for p in args.prefill], decode=args.decode, policy=args.policy,
        prefill_policy=args.prefill_policy, decode_policy=args.decode_policy,
        policy_options=_policy_options(args.policy_option), kv_events=_pairs(args.kv_events, "kv-events"),
        kv_replay=_pairs(args.kv_replay, "kv-replay"), models=args.model, api_key=args.api_key,
        admin_key=args.admin_key, worker_api_key=args.worker_api_key, max_body_bytes=int(args.max_body_mb * 2**20),
        max_connections=args.max_connections, max_client_connections=args.max_client_connections,
        read_timeout_s=args.read_timeout,
        retries=args.retries, connect_timeout_s=args.connect_timeout, first_token_timeout_s=args.first_token_timeout,
        request_timeout_s=args.request_timeout, health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout, health_failures=args.health_failures, breaker_threshold=args.breaker_threshold,
        breaker_cooldown_s=args.breaker_cooldown, disagg_threshold=args.disagg_threshold,
        tokenize=args.tokenize, retry_after_s=args.retry_after, etcd=args.etcd, etcd_prefix=args.etcd_prefix)


def run(args) -> int:
    cfg = config_from_args(args)
    cfg.validate()
    try:
        if cfg.processes > 1:
            from pdsdk.router.processes.parent import run as serve
        else:
            from pdsdk.router.server import run as serve
    except ImportError as e:
        raise MissingDependency("pdsdk router", "etcd", e) from e  # the extra that installs aiohttp
    serve(cfg)
    return 0
