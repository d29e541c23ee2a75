"""What `pdsdk launch` starts: one ProcessSpec per worker and one for the router.

Each engine adapter builds its own workers' command lines (they know their engine's flags); this
module only assigns ports, GPUs or CPU cores, and the router in front.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from pdsdk.config import load_config
from pdsdk.errors import ConfigError, MissingDependency
from pdsdk.ports import free_port
from pdsdk.router.config import MAX_PROCESSES

ENGINES = ("vllm", "sglang")
# What `pdsdk launch` says when an engine is missing: its pdsdk extra, and what it needs to serve.
ENGINE_NEEDS = {"vllm": "vLLM", "sglang": "SGLang, which serves on NVIDIA GPUs only"}
# The engine flag for the share of a GPU's memory one worker takes, and the share of the whole GPU
# its workers take together when several share it (the rest: CUDA contexts, activations, NCCL).
GPU_MEMORY_FLAG = {"vllm": "--gpu-memory-utilization", "sglang": "--mem-fraction-static"}
SHARED_GPU_MEMORY = 0.85
# --kv-events-config for the kv_events policy: each worker publishes its KV events on local sockets
# (ipc:// endpoints are bound by both engines' publishers, and reach no other machine).
KV_EVENTS_CONFIG = {"vllm": {"enable_kv_cache_events": True, "publisher": "zmq"}, "sglang": {"publisher": "zmq"}}


@dataclass
class ProcessSpec:
    name: str  # "prefill-0", "decode-1", "router"
    role: str  # prefill | decode | worker | router
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's environment
    port: int = 0
    health_path: str = "/health"  # ready to serve (the launcher waits for it at start)
    live_path: str = "/health"  # alive: failing this for --unhealthy-timeout gets the process restarted
    listen: bool = False  # serves on a socket the launcher holds: no connection refused while it restarts
    kv_events: tuple[str, str] | None = None  # (events, replay) endpoints the worker publishes on

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class LaunchPlan:
    engine: str
    model: str
    served_name: str
    config: dict[str, Any]  # the pdsdk connector config every worker gets
    workers: list[ProcessSpec]
    router: ProcessSpec
    host: str
    # Workers that may start together. Workers sharing a GPU start one after another: each sizes its
    # KV pool from the memory it sees free, which a neighbour's start would change under it.
    waves: list[list[ProcessSpec]] = field(default_factory=list)
    ipc_dir: str | None = None  # for the workers' KV event sockets: made at start (0700), removed at stop

    @property
    def processes(self) -> list[ProcessSpec]:
        return [*self.workers, self.router]

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.router.port}/v1"


@dataclass
class LaunchOptions:
    engine: str
    model: str
    transport: str = "nixl"
    store: Any = None
    prefill: int = 1
    decode: int = 1
    tp: int = 1
    gpus: list[int] | None = None
    # Heterogeneous TP: a prefill or decode TP other than `tp` (vLLM slices pages by KV head), and
    # the GPUs of each worker in role order (prefill first), which may overlap (instead of `gpus`).
    prefill_tp: int | None = None
    decode_tp: int | None = None
    worker_gpus: list[list[int]] | None = None
    policy: str = "least_load"
    host: str = "127.0.0.1"
    port: int = 8000
    local_prefill_threshold: int = 0
    router_processes: int | None = None  # the router's --processes (None: its default)
    served_name: str | None = None
    engine_args: list[str] = field(default_factory=list)
    python: str = sys.executable


def build_plan(opts: LaunchOptions) -> LaunchPlan:
    """Validate the options and lay out every process; raises ConfigError naming the option."""
    if opts.engine not in ENGINES:
        raise ConfigError("--engine", f"unknown engine {opts.engine!r}; valid: {', '.join(ENGINES)}")
    if opts.decode < 1 or opts.prefill < 0 or opts.tp < 1:
        raise ConfigError("--prefill/--decode/--tp", "need --decode >= 1, --prefill >= 0 and --tp >= 1")
    if opts.router_processes is not None and not 1 <= opts.router_processes <= MAX_PROCESSES:
        raise ConfigError("--router-processes", f"must be 1 to {MAX_PROCESSES}, not {opts.router_processes}")
    config = {"transport": opts.transport if opts.prefill else None, "failure_policy": "recompute"}
    if opts.store:
        config["store"] = opts.store
    load_config(config)  # fail here, naming the field, not in every worker
    served = opts.served_name or os.path.basename(os.path.normpath(opts.model))
    roles = ["prefill"] * opts.prefill + (["decode"] if opts.prefill else ["worker"]) * opts.decode
    tps = [{"prefill": opts.prefill_tp, "decode": opts.decode_tp}.get(role) or opts.tp for role in roles]
    if min(tps) < 1:
        raise ConfigError("prefill_tp/decode_tp", f"must be >= 1, got {tps}")
    if opts.worker_gpus is not None:
        if len(opts.worker_gpus) != len(roles) or any(len(g) != tp for g, tp in zip(opts.worker_gpus, tps)):
            raise ConfigError("worker_gpus", f"one GPU list per worker ({roles}) of its TP ({tps}), "
                                             f"got {opts.worker_gpus}")
        slots = [{"CUDA_VISIBLE_DEVICES": ",".join(map(str, g))} for g in opts.worker_gpus]
    elif len(set(tps)) > 1:
        raise ConfigError("worker_gpus", "workers of different TP need their GPUs given per worker")
    else:
        slots = placements(len(roles), opts.tp, opts.gpus, roles)
    sharing, turns = gpu_sharing(slots)
    ipc_dir = _kv_events_dir(opts)
    counters: dict[str, int] = {}
    workers = []
    for role, placement, tp, share in zip(roles, slots, tps, sharing):
        index = counters[role] = counters.get(role, -1) + 1
        name, port = f"{role}-{index}", free_port()
        events = (f"ipc://{ipc_dir}/{name}.events", f"ipc://{ipc_dir}/{name}.replay") if ipc_dir else None
        cmd, env = _worker_command(opts, role, port, served, config, tp, share, events)
        env.update(placement)
        workers.append(ProcessSpec(name, role, cmd, env, port, kv_events=events))
    router = ProcessSpec("router", "router", _router_command(opts, workers), {}, opts.port, live_path="/live",
                         listen=True)
    waves = [[w for w, t in zip(workers, turns) if t == turn] for turn in sorted(set(turns))]
    return LaunchPlan(opts.engine, opts.model, served, config, workers, router, opts.host, waves, ipc_dir)


def require_engine(engine: str) -> None:
    """Fail before any process starts when the engine cannot be imported by this Python."""
    try:
        found = importlib.util.find_spec(engine) is not None
    except (ImportError, ValueError):  # a broken install, or an import blocked on purpose
        found = False
    if not found:
        raise MissingDependency(f"pdsdk launch --engine {engine} ({ENGINE_NEEDS[engine]})", engine,
                                f"no module named {engine!r} in {sys.executable}")


def _kv_events_dir(opts: LaunchOptions) -> str | None:
    """Where the workers' KV event sockets go, when the router's policy reads them (kv_events)."""
    if opts.policy != "kv_events":
        return None
    if any(a == "--kv-events-config" or a.startswith("--kv-events-config=") for a in opts.engine_args):
        raise ConfigError("--kv-events-config", "--policy kv_events sets it for every worker (local sockets "
                                                "the router reads); drop it from the engine arguments")
    # short: a socket path must fit in 107 bytes
    return os.path.join(tempfile.gettempdir(), f"pdsdk-kv-{secrets.token_hex(4)}")


def gpu_sharing(slots: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Per worker: how many workers share its busiest GPU (1 on CPU), and its turn to start there."""
    gpus = [s["CUDA_VISIBLE_DEVICES"].split(",") if "CUDA_VISIBLE_DEVICES" in s else [] for s in slots]
    users: dict[str, int] = {}
    for ids in gpus:
        for g in ids:
            users[g] = users.get(g, 0) + 1
    seen: dict[str, int] = {}
    turns = []
    for ids in gpus:
        turns.append(max((seen.get(g, 0) for g in ids), default=0))
        for g in ids:
            seen[g] = seen.get(g, 0) + 1
    return [max((users[g] for g in ids), default=1) for ids in gpus], turns


def placements(n: int, tp: int, gpus: list[int] | None, roles: list[str] | None = None) -> list[dict[str, str]]:
    """CUDA_VISIBLE_DEVICES per worker on GPUs; a slice of the CPU cores per worker otherwise.

    A GPU id given twice (`--gpus 0,0,1`) is shared by two workers: each gets part of its memory.
    On CPU, prefill workers and decode workers get cores of their own when there are enough (1P2D on
    two cores: the prefill one, both decode workers the other): a decode worker polls its transfer
    on its core without pause, and a prefill sharing that core could not serve the read it waits for.
    """
    if gpus:
        if len(gpus) < n * tp:
            raise ConfigError("--gpus", f"{n} workers x TP {tp} need {n * tp} GPU ids, got {len(gpus)}: {gpus}; "
                                        "repeat an id to share a GPU (e.g. 0,0,1)")
        return [{"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus[i * tp:(i + 1) * tp]))} for i in range(n)]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    roles = roles or ["worker"] * n
    prefills = roles.count("prefill")
    if 0 < prefills < n and len(cores) > 1:  # split: prefill cores first, in proportion, one at least each side
        split = min(len(cores) - 1, max(1, round(len(cores) * prefills / n)))
        pools = {"prefill": cores[:split], "other": cores[split:]}
    else:
        pools = {"prefill": cores, "other": cores}
    out, seen = [], {"prefill": 0, "other": 0}
    for role in roles:
        pool_name = "prefill" if role == "prefill" else "other"
        pool, i = pools[pool_name], seen[pool_name]
        seen[pool_name] += 1
        per = max(1, len(pool) // (prefills if pool_name == "prefill" else n - prefills or n))
        mine = pool[(i * per) % len(pool):(i * per) % len(pool) + per] or pool[:1]
        out.append({"VLLM_CPU_OMP_THREADS_BIND": f"{mine[0]}-{mine[-1]}" if len(mine) > 1 else str(mine[0]),
                    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")})
    return out


def _worker_command(opts: LaunchOptions, role: str, port: int, served: str, config: dict[str, Any],
                    tp: int | None = None, share: int = 1,
                    kv_events: tuple[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    tp = tp or opts.tp
    args = list(opts.engine_args)
    if kv_events:
        args += ["--kv-events-config", json.dumps({**KV_EVENTS_CONFIG[opts.engine], "endpoint": kv_events[0],
                                                   "replay_endpoint": kv_events[1]})]
    flag = GPU_MEMORY_FLAG[opts.engine]
    if share > 1 and not any(a == flag or a.startswith(flag + "=") for a in args):  # the user's share wins
        args += [flag, f"{int(SHARED_GPU_MEMORY / share * 100) / 100:.2f}"]
    if opts.engine == "vllm":
        from pdsdk.adapters.vllm.command import server_command

        if not opts.gpus and not opts.worker_gpus and "--block-size" not in args:
            args += ["--block-size", "32"]  # vLLM's CPU attention needs a multiple of 32
        # A plain worker gets the connector only for a store (prefix reuse, no PD: kv_both, no transport).
        if role == "worker":
            role = "both" if config.get("store") else None
        cmd = server_command(opts.model, port, host=opts.host, role=role,
                             pdsdk_config=config, served_name=served, tp=tp, python=opts.python,
                             extra_args=tuple(args))
        return cmd, {}
    from pdsdk.adapters.sglang.command import server_command as sglang_command

    return sglang_command(opts.model, port, host=opts.host, role=role, pdsdk_config=config, served_name=served,
                          tp=tp, python=opts.python, extra_args=tuple(args))


def _router_command(opts: LaunchOptions, workers: list[ProcessSpec]) -> list[str]:
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []  # a checkout in the cwd must not shadow pdsdk
    cmd = [opts.python, *safe_path, "-m", "pdsdk", "router", "--engine", opts.engine, "--host", opts.host,
           "--port", str(opts.port), "--policy", opts.policy]
    for w in workers:
        flag = {"prefill": "--prefill", "decode": "--decode", "worker": "--worker"}[w.role]
        cmd += [flag, w.url, *([w.env["PDSDK_BOOTSTRAP_PORT"]] if "PDSDK_BOOTSTRAP_PORT" in w.env else [])]
        if w.kv_events:
            cmd += ["--kv-events", f"{w.url}={w.kv_events[0]}", "--kv-replay", f"{w.url}={w.kv_events[1]}"]
    if opts.local_prefill_threshold:
        cmd += ["--disagg-threshold", str(opts.local_prefill_threshold)]
    if opts.router_processes is not None:
        cmd += ["--processes", str(opts.router_processes)]
    return cmd
