"""`pdsdk launch`: prefill and decode workers of vLLM or SGLang plus the router, in one command."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import signal
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("launch", help="start prefill/decode workers and the router; Ctrl-C stops everything",
                       description="Start PD workers of an engine with PdsdkConnector (or SGLang's pdsdk backend) "
                                   "and the pdsdk router in front. Arguments after `--` go to every engine worker.")
    p.add_argument("--engine", choices=("vllm", "sglang"), required=True, help="serving engine")
    p.add_argument("--model", required=True, help="model path or name, as the engine takes it")
    p.add_argument("--transport", default="nixl", help="KV transport (`pdsdk plugins --kind transport`; default nixl)")
    p.add_argument("--store", default=None, help='KV store: a name, or JSON such as \'{"tiered":["memory","disk"]}\'')
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1; 0 = plain serving, no PD)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size per worker (default 1)")
    p.add_argument("--gpus", default=None, help="GPU ids to use, e.g. 0,1; an id given twice is shared, e.g. "
                                                "0,0,1 (default: CPU, cores split between workers)")
    p.add_argument("--policy", default="least_load", help="router policy (default least_load; kv_events also wires each worker's KV event stream "
                                                     "to the router)")
    p.add_argument("--host", default="127.0.0.1", help="router address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="router port (default 8000)")
    p.add_argument("--local-prefill-threshold", type=int, default=0,
                   help="prompts with fewer uncached tokens go to a decode worker alone (default 0: never)")
    p.add_argument("--router-processes", type=int, default=None, metavar="N",
                   help="the router's serving processes (its --processes; default: the machine's cores up to 8; "
                        "--emit k8s: the router pod's CPU request, default 2)")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: the model folder)")
    p.add_argument("--log-dir", default=None, help="per-process logs (default ./pdsdk-logs/<time>)")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds to wait for health (default 900)")
    p.add_argument("--restart", choices=("on-failure", "always", "never"), default="on-failure",
                   help="once serving, start a process that dies or hangs again on its port: on-failure (default; "
                        "not after a clean exit), always, or never (any death stops everything)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of one process in a row (10 healthy minutes start the count again) before the "
                        "launcher gives up and stops everything (default 5)")
    p.add_argument("--unhealthy-timeout", type=float, default=60,
                   help="seconds a running process may fail its health check before it is killed and restarted "
                        "(default 60)")
    p.add_argument("--quiet", action="store_true", help="do not echo the processes' log lines")
    p.add_argument("--dry-run", action="store_true", help="print the commands and environment; start nothing")
    p.add_argument("--emit", nargs=2, metavar=("k8s", "DIR"), help="write Kubernetes manifests to DIR; start nothing")
    p.add_argument("--image", default="vllm/vllm-openai:v0.26.0", help="worker image for --emit k8s")
    p.add_argument("--router-image", default="pdsdk/router:latest", help="router image for --emit k8s")
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then extra flags for every engine worker")
    p.set_defaults(func=run)


def options_from_args(args):
    from pdsdk.launch.plan import LaunchOptions

    store = args.store
    if store and store.lstrip().startswith("{"):
        store = json.loads(store)
    extra = args.engine_args[1:] if args.engine_args[:1] == ["--"] else args.engine_args
    return LaunchOptions(engine=args.engine, model=args.model, transport=args.transport, store=store,
                         prefill=args.prefill, decode=args.decode, tp=args.tp,
                         gpus=[int(g) for g in args.gpus.split(",")] if args.gpus else None, policy=args.policy,
                         host=args.host, port=args.port, local_prefill_threshold=args.local_prefill_threshold,
                         router_processes=args.router_processes,
                         served_name=args.served_model_name, engine_args=list(extra))


def run(args) -> int:
    from rich.console import Console

    from pdsdk.launch.plan import build_plan
    from pdsdk.launch.restart import RestartPolicy

    console = Console()
    opts = options_from_args(args)
    plan = build_plan(opts)
    restart = RestartPolicy(args.restart, args.max_restarts, args.unhealthy_timeout, args.start_timeout)
    if args.emit:
        from pdsdk.launch import k8s

        if args.emit[0] != "k8s":
            console.print(f"[red]--emit {args.emit[0]}: only k8s is supported[/]")
            return 2
        for path in k8s.write(k8s.manifests(plan, opts, args.image, args.router_image, restart), args.emit[1]):
            console.print(f"wrote {path}")
        return 0
    if args.dry_run:
        for spec in plan.processes:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env.items())
            print(f"# {spec.name} ({spec.role}) on port {spec.port}")
            print(f"{env + ' ' if env else ''}{shlex.join(spec.cmd)}\n")
        return 0
    log_dir = Path(args.log_dir or Path("pdsdk-logs") / dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    return serve(plan, log_dir, console, args.start_timeout, echo=not args.quiet, restart=restart)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def serve(plan, log_dir: Path, console, start_timeout: float, echo: bool = True, after_start=None,
          restart=None) -> int:
    """Start, wait for health, then run `after_start(plan)` (the demo) or keep it up until Ctrl-C."""
    from pdsdk.launch.plan import require_engine
    from pdsdk.launch.supervisor import ChildDied, Supervisor
    from pdsdk.ports import require_free

    require_engine(plan.engine)  # now, not from a worker's log after the others have started
    require_free(plan.host, plan.router.port, "--port")  # now, not after the engines have loaded
    sup = Supervisor(plan, log_dir, console, echo=echo, restart=restart)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops as cleanly as Ctrl-C
    try:
        for wave in plan.waves:
            sup.start(wave)
            sup.wait_healthy(wave, start_timeout)
        sup.start([plan.router])
        sup.wait_healthy([plan.router], 60)
        console.print(f"\n[bold green]ready[/]: {plan.endpoint}  (model {plan.served_name!r}; logs in {log_dir}, "
                      f"processes and restarts in {log_dir}/status.json)")
        console.print(f"try: curl {plan.endpoint}/chat/completions -H 'Content-Type: application/json' "
                      f"-d '{{\"model\": \"{plan.served_name}\", \"messages\": [{{\"role\": \"user\", "
                      f"\"content\": \"Hello!\"}}], \"max_tokens\": 32}}'")
        if after_start is not None:
            return after_start(plan, sup)
        sup.watch()
        return 0
    except ChildDied as e:
        console.print(f"[red]error:[/] {e}\nstopping everything; logs in {log_dir}")
        return 1
    except TimeoutError as e:
        console.print(f"[red]error:[/] {e}")
        return 1
    except KeyboardInterrupt:
        console.print("\nstopping...")
        return 130
    finally:
        sup.stop()
        signal.signal(signal.SIGTERM, previous)
        console.print("all processes stopped")
        sys.stdout.flush()
