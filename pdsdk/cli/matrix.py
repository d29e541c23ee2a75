"""`pdsdk matrix`: launch every selected engine x topology x transport x store cell, check greedy outputs
against a single engine, load it, collect transfer/store metrics, tear down, next; then write results
JSON, a markdown table and an HTML report. `pdsdk matrix report` merges results files into the docs."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

EXAMPLES = """examples:
  pdsdk matrix --preset ci                      # the CPU tier of `make test` (vLLM single + 1P1D nixl/local x none/memory)
  pdsdk matrix --preset cpu --md docs/matrix.md --compat-md docs/compat.md     # `make matrix`
  pdsdk matrix --engines vllm --transports nixl,mooncake,nccl --stores none,memory,redis --topologies 1P1D,2P1D
  pdsdk matrix --model /models/Qwen3-8B --gpus 0,1 --tier gpu-h200 --seed-tables --faults
  pdsdk matrix report cpu/results.json gpu/results.json --md docs/matrix.md --compat-md docs/compat.md
"""

PRESETS = {
    # The CPU tier `make test` runs (about 10 minutes on 2 cores).
    "ci": {"engines": "vllm", "topologies": "single,1P1D", "transports": "nixl,local", "stores": "none,memory"},
    # The full CPU tier (`make matrix`): every transport and store that runs here, the seed's layouts, chaos.
    "cpu": {"engines": "vllm", "topologies": "single,1P1D", "transports": "nixl,mooncake,nccl,local",
            "stores": "none,memory,disk,redis", "seed_tables": True, "faults": True},
}

# Load per cell: the seed's (GPU) and a CPU scale that keeps a cell to a minute on 2 cores with the tiny model.
SCALES = {
    "gpu": {"isl": 1024, "osl": 256, "num_prompts": 200, "request_rate": 20.0, "low": (50, 5.0),
            "fault_requests": 3000, "fault_rate": 10.0, "deadline": 120.0},
    "cpu": {"isl": 256, "osl": 32, "num_prompts": 24, "request_rate": 4.0, "low": (8, 1.0),
            "fault_requests": 400, "fault_rate": 1.0, "deadline": 120.0},
}


def register(sub) -> None:
    p = sub.add_parser("matrix", help="run engine x transport x store x topology cells: correctness, load, metrics, "
                                      "reports", description=__doc__, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--preset", choices=sorted(PRESETS), help="a named selection: ci (make test's CPU tier), cpu (make matrix)")
    a("--engines", default=None, help="comma-separated: vllm, sglang (default vllm)")
    a("--topologies", default=None, help="comma-separated: single, xPyD such as 1P1D, 2P1D (default single,1P1D)")
    a("--transports", default=None, help="comma-separated transports for PD cells (default nixl)")
    a("--stores", default=None, help="comma-separated: none, memory, disk, redis, mooncake (default none)")
    a("--tp", default="1", help="comma-separated tensor parallel sizes per worker (default 1; >1 needs --gpus)")
    a("--seed-tables", action="store_true", help="also the seed article's layouts: single vs TP=2 vs PD 1P1D at low and "
                                                "high load, prefix cache cold/warm/flush, chunked prefill off, FP8 KV")
    a("--faults", action="store_true",
      help="also a chaos run: killed prefill and decode workers and router (restarted by the launcher), stalled "
           "transfers, a store outage (2P2D on GPUs, 1P2D on CPU)")
    a("--fault-requests", type=int, default=None, help="requests in the chaos run (default 3000 on GPUs, 400 on CPU: "
                                                       "long enough for each kind once, restarts included)")
    a("--fault-rate", type=float, default=None, help="chaos arrivals per second (default 10 on GPUs, 1 on CPU)")
    a("--fault-kinds", default="stall_prefill,store_outage,kill_decode,kill_router,kill_prefill",
      help="chaos: faults to inject (default all five); 'none' runs the same load without faults (a control)")
    a("--deadline", type=float, default=None, help="chaos: seconds a request may take before it counts as late "
                                                   "(default 120)")
    a("--model", default=None, help="model folder or name (default: the tiny local model, made under --out)")
    a("--served-model-name", default=None, help="name clients use (default: the model folder's name)")
    a("--vocab", type=int, default=None, help="prompt ids drawn below this (default: the model's tokenizer.json)")
    a("--gpus", default=None, help="GPU ids, e.g. 0,1 (default: CPU)")
    a("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
      help="vLLM's batch-invariant mode on GPUs, so greedy outputs can be held to the baseline token for "
           "token (default: on with --gpus; its kernels are slower, so for speed rows pass "
           "--no-batch-invariant: outputs are then reported, not judged)")
    a("--tier", default=None, help="name of this machine's rows in the reports (default cpu, or gpu with --gpus)")
    a("--num-prompts", type=int, default=None, help="requests per cell (default 200 on GPUs, 24 on CPU)")
    a("--isl", type=int, default=None, help="input tokens per request (default 1024 on GPUs, 256 on CPU)")
    a("--osl", type=int, default=None, help="output tokens per request (default 256 on GPUs, 32 on CPU)")
    a("--request-rate", type=float, default=None, help="Poisson arrivals per second (default 20 on GPUs, 4 on CPU)")
    a("--max-concurrency", type=int, default=0, help="requests in flight at most (default unbounded)")
    a("--engine-args", default="", help="extra flags for every engine worker, one string, e.g. '--max-model-len 4096'")
    a("--python", default=None, help="interpreter the workers run with (default: this one)")
    a("--start-timeout", type=float, default=900, help="seconds a cell's workers may take to start (default 900)")
    a("--out", default=None, help="results, reports and logs go here (default ./pdsdk-logs/matrix-<time>)")
    a("--md", default=None, help="also update this markdown file's section for this tier (e.g. docs/matrix.md)")
    a("--compat-md", default=None, help="also update this compatibility table (e.g. docs/compat.md)")
    a("--only", default=None, help="comma-separated glob patterns over cell keys: run just these, e.g. "
                                   "'vllm/1P1D/*/memory,seed:*' (see --list)")
    a("--list", action="store_true", help="print the cells (and why any cannot run here) and start nothing")
    a("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=run)
    sub2 = p.add_subparsers(dest="matrix_action", metavar="report")
    r = sub2.add_parser("report", help="merge results files into markdown and HTML reports")
    r.add_argument("results", nargs="+", help="results.json files written by `pdsdk matrix`")
    r.add_argument("--md", default=None, help="markdown file whose per-tier sections are replaced (or appended)")
    r.add_argument("--compat-md", default=None, help="compatibility markdown file, per-tier sections likewise")
    r.add_argument("--html", default=None, help="write the HTML report here")
    r.set_defaults(func=report)


def _selection(args) -> dict:
    chosen = dict(PRESETS.get(args.preset or "", {}))
    for name, default in (("engines", "vllm"), ("topologies", "single,1P1D"), ("transports", "nixl"),
                          ("stores", "none")):
        given = getattr(args, name)
        chosen[name] = given if given is not None else chosen.get(name, default)
    chosen["seed_tables"] = args.seed_tables or chosen.get("seed_tables", False)
    chosen["faults"] = args.faults or chosen.get("faults", False)
    return chosen


def _check(args) -> None:
    from pdsdk.errors import ConfigError

    for name in ("num_prompts", "isl", "osl", "fault_requests"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be at least 1, got {v}")
    for name in ("request_rate", "fault_rate", "deadline"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be positive, got {v}")
    if args.batch_invariant and not args.gpus:
        raise ConfigError("--batch-invariant", "is vLLM's GPU mode; CPU cells are held exact without it: add --gpus "
                                               "or leave it out")


def build_cells(args, sel: dict, gpus, scale: dict):
    from pdsdk.errors import ConfigError
    from pdsdk.matrix import cells as C

    engines = C.split(sel["engines"], "--engines", C.ENGINES)
    topologies = C.split(sel["topologies"], "--topologies")
    transports = C.split(sel["transports"], "--transports")
    stores = C.split(sel["stores"], "--stores", C.STORES)
    try:
        tps = [int(t) for t in C.split(args.tp, "--tp")]
    except ValueError:
        raise ConfigError("--tp", f"{args.tp!r}: give integers, e.g. 1,2") from None
    isl, osl = args.isl or scale["isl"], args.osl or scale["osl"]
    main = C.Phase("load", args.num_prompts or scale["num_prompts"], isl, osl,
                   args.request_rate or scale["request_rate"], args.max_concurrency)
    cells = C.grid(engines, topologies, transports, stores, tps)
    for cell in cells:
        cell.phases = [main]
    if sel["seed_tables"]:
        n_low, r_low = scale["low"]
        # distinct seeds: phases on a shared launch must not hit each other's prefixes by accident
        low = C.Phase("low", n_low, isl, osl, r_low, args.max_concurrency, seed=1)
        high = C.Phase("high", main.num_prompts, isl, osl, main.rate, args.max_concurrency, seed=2)
        prefix = C.Phase("prefix", n_low, isl, osl, r_low, seed=3)
        for engine in engines:
            cells += C.seed_cells(engine, transports[0], low, high, prefix)
    if args.only:
        import fnmatch

        patterns = C.split(args.only, "--only")
        cells = [c for c in cells if any(fnmatch.fnmatchcase(c.key, p) for p in patterns)]
        if not cells:
            raise ConfigError("--only", f"{args.only!r} matches no cell; `pdsdk matrix --list` shows the keys")
    for cell in cells:
        cell.skip = C.why_not(cell, gpus)
    return cells


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from pdsdk.bench.log import machine
    from pdsdk.errors import ConfigError
    from pdsdk.matrix import report_html, report_md
    from pdsdk.matrix.runner import MatrixOptions, Runner, Status
    from pdsdk.matrix.versions import worker_versions
    from pdsdk.matrix.workload import vocab_size

    _check(args)
    sel = _selection(args)
    try:
        gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
    except ValueError:
        raise ConfigError("--gpus", f"{args.gpus!r}: give GPU ids, e.g. 0,1") from None
    scale = SCALES["gpu" if gpus else "cpu"]
    cells = build_cells(args, sel, gpus, scale)
    console = Console(stderr=True)
    if args.list:
        for c in cells:
            console.print(f"{c.key:45} " + (f"[yellow]skip[/]: {c.skip}" if c.skip else "[green]runs[/]"))
        return 0
    out = Path(args.out or Path("pdsdk-logs") / time.strftime("matrix-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not model:
        from pdsdk.tinymodel import make_tiny_model

        model = str(make_tiny_model(out / "tiny"))
    try:
        vocab = args.vocab or vocab_size(model if Path(model).is_dir() else None)
    except FileNotFoundError as e:
        raise ConfigError("--vocab", f"{e}; give --vocab for a model without tokenizer.json") from None
    opts = MatrixOptions(model=model, out=out, tier=args.tier or ("gpu" if gpus else "cpu"), vocab=vocab,
                         served_name=args.served_model_name, gpus=gpus, python=args.python or MatrixOptions.python,
                         engine_args=shlex.split(args.engine_args), start_timeout_s=args.start_timeout,
                         machine=machine(),
                         batch_invariant=bool(gpus) if args.batch_invariant is None else args.batch_invariant)
    faults = None
    if sel["faults"]:
        from pdsdk.matrix.faults import FaultOptions

        faults = FaultOptions(requests=args.fault_requests or scale["fault_requests"],
                              rate=args.fault_rate or scale["fault_rate"], deadline_s=args.deadline or scale["deadline"],
                              transport=C_first(sel["transports"]), engine=C_first(sel["engines"]),
                              prefill=2 if gpus else 1, kinds=fault_kinds(args.fault_kinds))
    runnable = [c for c in cells if not c.skip]
    total = len(runnable) + (1 if faults else 0)
    console.print(f"[bold]pdsdk matrix[/]: {len(cells)} cells ({len(cells) - len(runnable)} cannot run here), "
                  f"{'chaos run, ' if faults else ''}tier {opts.tier}; model {model}; out {out}")
    started = time.monotonic()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, disable=args.quiet, transient=False) as bar:
        task = bar.add_task("cells", total=total)

        def on_cell(rec) -> None:
            color = {"ok": "green", "failed": "red", "skipped": "yellow"}[rec["status"]]
            took = rec.get("timings", {}).get("total_s")
            bar.console.print(f"[{color}]{rec['status']:>7}[/] {rec.get('key', rec.get('id'))}"
                              + (f" ({took:.0f}s)" if took else "") + (f": {rec['reason']}" if rec["reason"] else ""))
            if rec["status"] != "skipped" and rec["group"] != "baseline":  # a baseline engine is not a cell
                bar.advance(task)

        status = Status(lambda text: bar.update(task, description=text[:90]))
        runner = Runner(opts, status, on_cell)
        status("asking the workers' Python for versions")
        runner.start_record(worker_versions(opts.python), {**sel, "tp": args.tp, "gpus": gpus,
                                                            "engine_args": opts.engine_args})
        if faults:
            from pdsdk.matrix.faults import chaos_workload

            runner.extra_baselines["faults"] = chaos_workload(faults, vocab)
        runner.run(cells)
        if faults:
            from pdsdk.matrix.faults import run_chaos

            runner.record["faults"] = run_chaos(runner, faults, status)
            runner.save()
            bar.advance(task)
    record = runner.record
    record["duration_s"] = round(time.monotonic() - started, 1)
    path = runner.save()
    md = report_md.render([record])
    (out / "matrix.md").write_text(md)
    html_path = out / "report.html"
    report_html.write([record], html_path)
    if args.md:
        report_md.update_doc(args.md, [record])
    if args.compat_md:
        report_md.update_compat(args.compat_md, [record])
    print(md)
    console.print(f"results: {path}\nreport:  {html_path}\nlogs:    {out / 'logs'}\n"
                  f"took {record['duration_s'] / 60:.1f} min")
    bad = [c for c in record["cells"] if c["status"] == "failed"]
    chaos = record.get("faults") or {}
    return 1 if bad or (chaos and not chaos.get("ok")) else 0


def fault_kinds(value: str) -> tuple[str, ...]:
    from pdsdk.errors import ConfigError
    from pdsdk.matrix.faults import KINDS

    if value.strip() == "none":
        return ()
    kinds = tuple(k.strip() for k in value.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ConfigError("--fault-kinds", f"unknown {', '.join(bad) or 'empty list'}; valid: {', '.join(KINDS)}, "
                                           "or none")
    return kinds


def C_first(value: str) -> str:
    return value.split(",")[0].strip()


def report(args) -> int:
    from rich.console import Console

    from pdsdk.matrix import report_html, report_md
    from pdsdk.matrix.results import load_results

    records = [load_results(p) for p in args.results]
    if args.md:
        report_md.update_doc(args.md, records)
    if args.compat_md:
        report_md.update_compat(args.compat_md, records)
    if args.html:
        report_html.write(records, Path(args.html))
    if not (args.md or args.compat_md or args.html):
        Console().print(report_md.render(records))
    return 0
