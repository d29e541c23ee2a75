"""`pdsdk bench serve` (load against any OpenAI-compatible endpoint) and `pdsdk bench compare` (results side by side)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdsdk.bench.log import append_rows, machine

SECTION = "Serving (`pdsdk bench serve`)"
KIND = "pdsdk-bench-serve"


def register(sub) -> None:
    p = sub.add_parser("serve", help="load an OpenAI-compatible endpoint: TTFT, ITL, E2E, throughput",
                       description=__doc__)
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 (router or engine)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--workload", choices=("random", "agent"), default="random",
                   help="random prompts (default) or a multi-turn tool-using agent")
    p.add_argument("--num-prompts", type=int, default=100, help="random: requests to send (default 100)")
    p.add_argument("--isl", type=int, default=1024, help="random: input tokens per request (default 1024)")
    p.add_argument("--osl", type=int, default=256, help="output tokens per request (agent: the answer; default 256)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in x(1±r) (default 0)")
    p.add_argument("--sessions", type=int, default=8, help="agent: sessions (default 8)")
    p.add_argument("--turns", type=int, default=4, help="agent: turns per session (default 4)")
    p.add_argument("--system-tokens", type=int, default=1024, help="agent: shared system prompt + tools (default 1024)")
    p.add_argument("--tool-tokens", type=int, default=128, help="agent: tool result per turn (default 128)")
    p.add_argument("--reasoning-tokens", type=int, default=64, help="agent: reasoning per turn (default 64)")
    p.add_argument("--tool-gap", type=float, default=2.0, help="agent: seconds between turns (default 2)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (requests, or agent sessions); default inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=0, help="requests in flight at most (default unbounded)")
    p.add_argument("--warmup", type=int, default=1, help="short requests sent first, not measured (default 1)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: generate exactly the output length)")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json: prompt ids drawn from its vocabulary")
    p.add_argument("--vocab", type=int, default=1000, help="prompt ids drawn below this without --tokenizer")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals: same seed, same requests")
    p.add_argument("--timeout", type=float, default=600, help="seconds per request (default 600)")
    p.add_argument("--api-key", default=None, help="bearer token for the endpoint")
    p.add_argument("--label", default=None, help="name of this run in reports (default: the URL)")
    p.add_argument("--machine", default=None, help="describe the serving machine (default: this one)")
    p.add_argument("--json", dest="json_out", help="write the result (summary and every request) to this file")
    p.add_argument("--doc", default="", help="markdown file to append a row to (e.g. docs/benchmarks.md)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)

    c = sub.add_parser("compare", help="`pdsdk bench serve` results side by side, with ratios to the first")
    c.add_argument("results", nargs="+", help="JSON files written by `pdsdk bench serve --json`")
    c.set_defaults(func=compare)


def workload_from_args(args) -> Any:
    from pdsdk.matrix.workload import AgentSpec, Workload, vocab_size

    agent = AgentSpec(sessions=args.sessions, turns=args.turns, system=args.system_tokens, user=64,
                      tool_result=args.tool_tokens, reasoning=args.reasoning_tokens, gap_s=args.tool_gap)
    return Workload(args.workload, num_prompts=args.num_prompts, isl=args.isl, osl=args.osl,
                    range_ratio=args.range_ratio, vocab=vocab_size(args.tokenizer, args.vocab), seed=args.seed,
                    agent=agent)


def _check(args) -> None:
    from pdsdk.errors import ConfigError

    for name in ("num_prompts", "isl", "osl", "sessions", "turns"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be at least 1, got {getattr(args, name)}")
    if args.request_rate <= 0:
        raise ConfigError("--request-rate", f"must be positive (inf for all at once), got {args.request_rate}")
    if args.vocab <= 100 and not args.tokenizer:
        raise ConfigError("--vocab", f"{args.vocab} is too small to draw prompt ids from; give at least 101")


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from pdsdk.matrix.loadgen import LoadOptions, run_load, summarize

    _check(args)
    workload = workload_from_args(args)
    opts = LoadOptions(args.url, args.model, args.request_rate, args.max_concurrency, args.warmup, args.timeout,
                       args.ignore_eos, True, args.api_key, args.seed)
    total = workload.agent.sessions * workload.agent.turns if workload.kind == "agent" else workload.num_prompts
    console = Console(stderr=True)
    console.print(f"[bold]pdsdk bench serve[/] {args.url}: {workload.describe()}, rate {args.request_rate}/s, "
                  f"concurrency {args.max_concurrency or 'unbounded'}")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("errors {task.fields[errors]}"), console=console, disable=args.quiet) as bar:
        task = bar.add_task("requests", total=total, errors=0)
        errors = 0

        def tick(res) -> None:
            nonlocal errors
            errors += not res.ok
            bar.update(task, advance=1, errors=errors)

        results, wall, model = asyncio.run(run_load(opts, workload, tick))
    summary = summarize(results, wall)
    if workload.kind == "agent":
        summary["ttft_ms_by_turn"] = _by_turn(results)
    record = {"kind": KIND, "label": args.label or args.url, "url": args.url, "model": model,
              "date": dt.datetime.now().isoformat(timespec="seconds"), "machine": args.machine or machine(),
              "workload": asdict(workload), "describe": workload.describe(),
              "load": {"request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
                       "warmup": args.warmup, "ignore_eos": args.ignore_eos},
              "summary": summary,
              "requests": [{"ok": r.ok, "start_s": round(r.start_s, 4), "ttft_ms": round(r.ttft_s * 1e3, 3),
                            "e2e_ms": round(r.e2e_s * 1e3, 3), "prompt_tokens": r.prompt_tokens,
                            "output_tokens": r.output_tokens, "itl_ms": [round(x * 1e3, 3) for x in r.itl_s],
                            "session": r.session, "turn": r.turn, "error": r.error} for r in results]}
    print_summary(record)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(record) + "\n")
    if args.doc:
        append_rows(args.doc, SECTION, [doc_row(record)])
    return 0 if summary["errors"] == 0 else 1


def _by_turn(results) -> dict[str, float]:
    turns: dict[int, list[float]] = {}
    for r in results:
        if r.ok:
            turns.setdefault(r.turn, []).append(r.ttft_s * 1e3)
    return {str(t): sum(v) / len(v) for t, v in sorted(turns.items())}


def _f(x: float) -> str:
    return "-" if x != x else f"{x:.1f}"  # NaN when nothing completed


def doc_row(rec: dict) -> list[str]:
    """The docs/benchmarks.md row after date and machine (append_rows adds those two; machine is this host's)."""
    s, load = rec["summary"], rec["load"]
    return [rec["label"], rec["describe"], f"{load['request_rate']}/s, c={load['max_concurrency'] or '-'}",
            _f(s["ttft_ms"]["mean"]), _f(s["ttft_ms"]["p99"]), _f(s["itl_ms"]["p99"]), _f(s["e2e_ms"]["mean"]),
            f"{s['output_throughput']:.1f}", f"{s['request_throughput']:.2f}", str(s["errors"])]


def print_summary(rec: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s = rec["summary"]
    table = Table(title=rec["label"], caption=rec["describe"])
    for col in ("metric", "mean", "p50", "p95", "p99"):
        table.add_column(col, justify="right" if col != "metric" else "left")
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        d = s[name]
        table.add_row(name.replace("_ms", " (ms)").upper(), *(_f(d[k]) for k in ("mean", "p50", "p95", "p99")))
    console = Console()
    console.print(table)
    console.print(f"completed {s['completed']}/{s['requests']}, errors {s['errors']}, {s['duration_s']:.1f} s; "
                  f"output {s['output_throughput']:.1f} tok/s, {s['request_throughput']:.2f} req/s")
    if s.get("ttft_ms_by_turn"):
        console.print("TTFT mean by turn (ms): " + ", ".join(f"{t}: {v:.1f}" for t, v in s["ttft_ms_by_turn"].items()))
    for reason in s["error_reasons"]:
        console.print(f"[red]error[/]: {reason}")


COMPARED = [("TTFT mean ms", "ttft_ms", "mean", -1), ("TTFT p99 ms", "ttft_ms", "p99", -1),
            ("ITL mean ms", "itl_ms", "mean", -1), ("ITL p99 ms", "itl_ms", "p99", -1),
            ("E2E mean ms", "e2e_ms", "mean", -1), ("E2E p99 ms", "e2e_ms", "p99", -1),
            ("output tok/s", "output_throughput", None, 1), ("requests/s", "request_throughput", None, 1),
            ("errors", "errors", None, -1)]


def load_result(path: str) -> dict:
    from pdsdk.errors import ConfigError

    try:
        rec = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(path, f"cannot read a bench result ({e})") from None
    if not isinstance(rec, dict) or rec.get("kind") != KIND:
        raise ConfigError(path, "is not a `pdsdk bench serve --json` result")
    return rec


def compare(args) -> int:
    from rich.console import Console
    from rich.table import Table

    recs = [load_result(p) for p in args.results]
    table = Table(title="pdsdk bench compare (ratio to the first column; green = better)")
    table.add_column("metric")
    for path, rec in zip(args.results, recs):
        table.add_column(f"{rec['label']}\n{Path(path).name}", justify="right")
    for title, key, sub, sign in COMPARED:
        values = [r["summary"][key] if sub is None else r["summary"][key][sub] for r in recs]
        cells = [_f(values[0]) if isinstance(values[0], float) else str(values[0])]
        for v in values[1:]:
            text = _f(v) if isinstance(v, float) else str(v)
            if values[0] and v == v and values[0] == values[0]:
                ratio = v / values[0]
                better = (ratio - 1) * sign > 0
                text += f" [{'green' if better else 'red' if ratio != 1 else 'white'}]x{ratio:.2f}[/]"
            cells.append(text)
        table.add_row(title, *cells)
    table.add_row("workload", *(r["describe"] for r in recs))
    Console().print(table)
    return 0
