"""`pdsdk demo` (what `make demo` runs): vLLM 1P1D with PdsdkConnector behind the pdsdk router on this
machine, a few chat requests through the official openai client, the transfer metrics, then a clean stop."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

QUESTIONS = ["Hello! How are you today?", "What is the capital of France?",
             "Write one line of Python that sums the squares of 0..9."]


def run_demo(plan, sup, console: Console) -> int:
    from openai import OpenAI

    client = OpenAI(base_url=plan.endpoint, api_key="none")
    console.rule("requests through the router (prefill -> KV transfer -> decode)")
    for q in QUESTIONS:
        start = time.monotonic()
        out = client.chat.completions.create(model=plan.served_name, messages=[{"role": "user", "content": q}],
                                             max_tokens=24, temperature=0)
        console.print(f"[bold]Q:[/] {q}\n[bold]A:[/] {out.choices[0].message.content!r}  "
                      f"[dim]({(time.monotonic() - start) * 1e3:.0f} ms)[/]")
    console.print("[dim](the tiny model has random weights: its words are noise; the point is the path they took)[/]")
    time.sleep(1.5)  # workers write their transfer stats at most once a second
    show_transfer_stats(sup.log_dir / "stats", console)
    console.rule("where to look next")
    console.print(f"logs of every process: {sup.log_dir}/\n"
                  f"run it yourself:       pdsdk launch --engine vllm --transport nixl --model {plan.model}\n"
                  "other transports:      --transport mooncake | nccl | local   (pdsdk plugins)\n"
                  "benchmarks:            pdsdk bench transport; pdsdk bench router; docs/benchmarks.md")
    return 0


def show_transfer_stats(directory: Path, console: Console) -> None:
    table = Table(title="KV transfers (decode side pulls from prefill)")
    for col in ("worker", "transport", "path", "transfers", "failed", "bytes", "ms total", "GB/s"):
        table.add_column(col)
    rows = 0
    for path in sorted(Path(directory).glob("*.json")):
        s = json.loads(path.read_text())
        if not s.get("transfers") and not s.get("failed"):
            continue  # a prefill worker: the decode side pulls, so its counters stay at zero
        rows += 1
        table.add_row(f"{s['engine_id'][:8]} tp{s['tp_rank']}", s["transport"], s["path"], str(s["transfers"]),
                      str(s["failed"]), f"{s['bytes']:,}", f"{s['seconds'] * 1e3:.2f}", str(s.get("gbps")))
    console.print(table if rows else f"[yellow]no transfer stats found in {directory}[/]")


def register(sub) -> None:
    p = sub.add_parser("demo", help="vLLM 1P1D with pdsdk on this machine: requests, transfer metrics, clean stop")
    p.add_argument("--model", default=None, help="model folder (default: make the tiny local model)")
    p.add_argument("--transport", default="nixl", help="KV transport (default nixl)")
    p.add_argument("--port", type=int, default=0, help="router port (default: a free port)")
    p.add_argument("--workdir", default=".pdsdk-demo", help="model and logs go here (default .pdsdk-demo)")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds to wait for the workers")
    p.add_argument("--verbose-logs", action="store_true", help="echo every worker log line")
    p.set_defaults(func=main)


def main(args) -> int:
    from pdsdk.cli.launch import serve
    from pdsdk.launch.plan import LaunchOptions, build_plan
    from pdsdk.ports import free_port
    from pdsdk.tinymodel import make_tiny_model

    console = Console()
    work = Path(args.workdir).resolve()
    model = args.model or str(make_tiny_model(work / "tiny"))
    plan = build_plan(LaunchOptions(engine="vllm", model=model, transport=args.transport, served_name="tiny",
                                    port=args.port or free_port()))
    console.print(f"starting vLLM prefill + decode with transport {args.transport!r} and the router "
                  "(first start compiles kernels: a minute or two on 2 cores)...")
    return serve(plan, work / "logs" / time.strftime("%Y%m%d-%H%M%S"), console, args.start_timeout,
                 echo=args.verbose_logs, after_start=lambda p, sup: run_demo(p, sup, console))
