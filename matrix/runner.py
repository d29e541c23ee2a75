"""Run the cells of `pdsdk matrix` one after another: launch (pdsdk.launch's build_plan and Supervisor,
the code `pdsdk launch` runs), check greedy outputs against the baseline, load it (the load generator
of `pdsdk bench serve`), collect transfer/store/router metrics, stop, next. A failing cell records why
(and its processes' last log lines) and the run goes on.

The baseline is one plain engine per engine and model, asked directly (no router, no connector). When
the selection has the plain single-worker cell, that cell's engine is the baseline's (one start fewer).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import json
import os
import sys
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from pdsdk.errors import PdsdkError
from pdsdk.launch.plan import LaunchOptions, LaunchPlan, ProcessSpec, build_plan
from pdsdk.launch.restart import RestartPolicy
from pdsdk.launch.supervisor import ChildDied, Supervisor
from pdsdk.matrix import correctness
from pdsdk.matrix.cells import Cell, Phase
from pdsdk.matrix.collect import collect, prefix_cache_counters
from pdsdk.matrix.loadgen import LoadOptions, run_load, summarize
from pdsdk.matrix.workload import Workload
from pdsdk.ports import free_port

KIND = "pdsdk-matrix"
SCHEMA = 1
STATS_SETTLE_S = 1.5  # workers write their stats files at most once a second


@dataclass
class MatrixOptions:
    model: str
    out: Path
    tier: str = "cpu"
    vocab: int = 1000
    served_name: str | None = None
    gpus: list[int] | None = None
    python: str = sys.executable
    engine_args: list[str] = field(default_factory=list)
    start_timeout_s: float = 900.0
    request_timeout_s: float = 300.0
    check_prompts: int = 8
    check_osl: int = 24
    machine: str = ""
    # vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1) on GPUs: without it bf16 sums change with the
    # batch and with a warm prefix cache, so an engine disagrees with its own earlier answers and a
    # token-for-token check says nothing (tests/gpu/invariance.py). Its kernels are slower.
    batch_invariant: bool = False

    def judges_exactly(self, engine: str) -> bool:
        """Whether greedy outputs can be held to the baseline token for token on this machine."""
        return not self.gpus or (self.batch_invariant and engine == "vllm")

    def engine_env(self, engine: str) -> dict[str, str]:
        return {"VLLM_BATCH_INVARIANT": "1"} if self.gpus and self.batch_invariant and engine == "vllm" else {}


class CellFailed(PdsdkError):
    def __init__(self, reason: str, tails: dict[str, list[str]] | None = None):
        super().__init__(reason)
        self.reason, self.tails = reason, tails or {}


class Status:
    """What the progress display shows: the current cell and step."""

    def __init__(self, update: Callable[[str], None] | None = None):
        self._update = update or (lambda text: None)

    def __call__(self, text: str) -> None:
        self._update(text)


# --- launching one cell -----------------------------------------------------------------------


class Running:
    """A launched cell: its plan, supervisor and router URL; `stop()` tears everything down."""

    def __init__(self, plan: LaunchPlan, sup: Supervisor, servers: list[Any]):
        self.plan, self.sup, self.servers = plan, sup, servers

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.plan.router.port}"

    def tails(self, n: int = 30) -> dict[str, list[str]]:
        return {name: list(t)[-n:] for name, t in self.sup.tails.items()}

    def stop(self) -> None:
        self.sup.stop()
        for s in self.servers:
            s.stop()


def store_spec(store: str, workdir: Path) -> tuple[Any, list[Any]]:
    """(the pdsdk store spec for `store`, servers started for it) for one cell."""
    if store == "none":
        return None, []
    if store == "memory":
        return "memory", []
    if store == "disk":
        return {"name": "disk", "options": {"path": str(workdir / "pages")}}, []
    from pdsdk.testing.servers import start_mooncake_master, start_redis

    workdir.mkdir(parents=True, exist_ok=True)  # the server's log and data go there, before any worker's log

    if store == "redis":
        server = start_redis(workdir)
        return {"name": "redis", "options": {"url": f"redis://127.0.0.1:{server.port}/0"}}, [server]
    if store == "mooncake":
        server = start_mooncake_master(workdir)
        return {"name": "mooncake", "options": {"master": f"127.0.0.1:{server.port}"}}, [server]
    raise CellFailed(f"store {store!r} has no matrix set-up; valid: none, memory, disk, redis, mooncake")


def wait_healthy(sup: Supervisor, specs: list[ProcessSpec], timeout_s: float, status: Status, what: str) -> None:
    start = time.monotonic()
    pending = {s.name: s for s in specs}
    while pending:
        sup.check_children()
        for name, spec in list(pending.items()):
            if answers(spec.url + spec.health_path):
                del pending[name]
        if not pending:
            return
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise TimeoutError(f"{', '.join(pending)} not healthy after {timeout_s:.0f}s "
                               "(raise --start-timeout if the machine is slow)")
        status(f"{what}: starting {', '.join(pending)} ({waited:.0f}s)")
        time.sleep(0.5)


def answers(url: str, timeout: float = 2) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=timeout).status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def launch(cell: Cell, opts: MatrixOptions, log_dir: Path, status: Status, *, worker_env: dict | None = None,
           router_args: tuple[str, ...] = (), store: Any = "auto") -> Running:
    servers: list[Any] = []
    if store == "auto":
        store, servers = store_spec(cell.store, log_dir)
    plan = build_plan(LaunchOptions(
        engine=cell.engine, model=opts.model, transport=cell.transport or "nixl", store=store, prefill=cell.prefill,
        decode=cell.decode, tp=cell.tp, gpus=opts.gpus, port=free_port(), served_name=opts.served_name,
        engine_args=[*opts.engine_args, *cell.engine_args()], python=opts.python))
    plan.router.cmd += list(router_args)
    for w in plan.workers:
        w.env.update({**opts.engine_env(cell.engine), **(worker_env or {})})
    sup = Supervisor(plan, log_dir, console=Console(file=io.StringIO()), echo=False,
                     restart=RestartPolicy(start_timeout_s=opts.start_timeout_s))
    running = Running(plan, sup, servers)
    try:
        for wave in plan.waves:
            sup.start(wave)
            wait_healthy(sup, wave, opts.start_timeout_s, status, cell.id)
        sup.start([plan.router])
        wait_healthy(sup, [plan.router], 60, status, cell.id)
    except BaseException:
        running.stop()
        raise
    return running


# --- measuring ---------------------------------------------------------------------------------


def phase_workload(phase: Phase, vocab: int) -> Workload:
    return Workload("random", num_prompts=phase.num_prompts, isl=phase.isl, osl=phase.osl, vocab=vocab,
                    seed=phase.seed)


def run_phase(url: str, phase: Phase, opts: MatrixOptions, served: str, warmup: int) -> dict[str, Any]:
    workload = phase_workload(phase, opts.vocab)
    load = LoadOptions(url, served, rate=phase.rate, concurrency=phase.concurrency, warmup=warmup,
                       timeout_s=opts.request_timeout_s)
    results, wall, _ = asyncio.run(run_load(load, workload))
    return {"label": phase.label, "phase": asdict(phase), "describe": workload.describe(),
            "summary": summarize(results, wall),
            "requests": [{"ok": r.ok, "ttft_ms": round(r.ttft_s * 1e3, 3), "e2e_ms": round(r.e2e_s * 1e3, 3),
                          "itl_ms": [round(x * 1e3, 3) for x in r.itl_s], "output_tokens": r.output_tokens,
                          "error": r.error} for r in results]}


def flush_prefix_cache(plan: LaunchPlan) -> list[str]:
    """POST /reset_prefix_cache to every worker (vLLM serves it with VLLM_SERVER_DEV_MODE=1)."""
    done = []
    for w in plan.workers:
        path = "/reset_prefix_cache" if plan.engine == "vllm" else "/flush_cache"
        req = urllib.request.Request(w.url + path, data=b"", method="POST")
        try:
            urllib.request.urlopen(req, timeout=30)
            done.append(w.name)
        except OSError as e:
            raise CellFailed(f"flushing the prefix cache of {w.name} failed ({e}); vLLM serves "
                             "/reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1") from None
    return done


# --- the run -----------------------------------------------------------------------------------


class Runner:
    def __init__(self, opts: MatrixOptions, status: Status | None = None,
                 on_cell: Callable[[dict[str, Any]], None] | None = None):
        self.opts, self.status = opts, status or Status()
        self.on_cell = on_cell or (lambda rec: None)
        self.baselines: dict[str, dict[str, Any]] = {}  # engine -> {"check": outputs, extra workloads...}
        self.extra_baselines: dict[str, Workload] = {}  # name -> workload the baseline also answers
        self.record: dict[str, Any] = {}

    # -- record -------------------------------------------------------------------------------

    def start_record(self, versions: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
        from pdsdk._version import __version__

        self.record = {"kind": KIND, "schema": SCHEMA, "tier": self.opts.tier, "machine": self.opts.machine,
                       "date": dt.datetime.now().isoformat(timespec="seconds"), "pdsdk": __version__,
                       "model": self.opts.model, "versions": versions, "options": options, "cells": [],
                       "baselines": {}, "faults": None}
        return self.record

    def save(self) -> Path:
        self.opts.out.mkdir(parents=True, exist_ok=True)
        path = self.opts.out / "results.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record) + "\n")
        tmp.replace(path)
        return path

    # -- baseline -----------------------------------------------------------------------------

    def check_workload(self) -> Workload:
        return correctness.check_workload(self.opts.vocab, self.opts.check_prompts, self.opts.check_osl)

    def take_baseline(self, engine: str, worker_url: str) -> None:
        self.status(f"{engine} baseline: greedy outputs of one plain engine")
        start = time.monotonic()
        outputs = {}
        for name, workload in {"check": self.check_workload(), **self.extra_baselines}.items():
            got, errors = correctness.collect(worker_url, workload, self.opts.served_name,
                                              timeout_s=self.opts.request_timeout_s)
            if errors or len(got) != workload.num_prompts:
                raise CellFailed(f"the baseline engine failed {len(errors)} of {workload.num_prompts} "
                                 f"{name} requests: {errors[:2]}")
            outputs[name] = got
        self.baselines[engine] = outputs
        self.record["baselines"][engine] = {"seconds": round(time.monotonic() - start, 1),
                                            **{k: len(v) for k, v in outputs.items()}}

    def baseline_cell(self, engine: str) -> Cell:
        return Cell(engine, 0, 1, None, group="baseline")

    # -- cells ---------------------------------------------------------------------------------

    def run(self, cells: list[Cell]) -> dict[str, Any]:
        for engine in dict.fromkeys(c.engine for c in cells if not c.skip):
            plain = [c for c in cells if c.engine == engine and not c.skip and is_plain(c)]
            if not plain:
                self.run_group([self.baseline_cell(engine)], baseline=True)
        for cell in (c for c in cells if c.skip):
            self._done(new_record(cell))
        groups: dict[tuple, list[Cell]] = {}
        for cell in sorted((c for c in cells if not c.skip), key=lambda c: not is_plain(c)):  # the plain cell first
            groups.setdefault(launch_key(cell), []).append(cell)
        for group in groups.values():
            self.run_group(group, baseline=is_plain(group[0]) and group[0].engine not in self.baselines)
        return self.record

    def run_group(self, cells: list[Cell], baseline: bool = False) -> None:
        """Cells with the same launch (e.g. the grid's 1P1D nixl and the seed tables') share one start."""
        recs = [new_record(c) for c in cells]
        lead = cells[0]
        log_dir = self.opts.out / "logs" / lead.key.replace("/", "_").replace(":", "_").replace("@", "_")
        t0 = time.monotonic()
        running = None
        pending = list(recs)
        step = "launch"
        try:
            env = {"VLLM_SERVER_DEV_MODE": "1"} if any(p.flush_before for c in cells for p in c.phases) else None
            running = launch(lead, self.opts, log_dir, self.status, worker_env=env)
            started = round(time.monotonic() - t0, 1)
            for rec in recs:
                rec["timings"]["start_s"] = started
                rec["shared_launch"] = [c.key for c in cells if c.key != rec["key"]]
            served = running.plan.served_name
            self.opts.served_name = self.opts.served_name or served
            if baseline:
                step = "baseline"
                self.take_baseline(lead.engine, running.plan.workers[0].url)
            if lead.group == "baseline":
                recs[0]["status"] = "ok"
                pending = []
                return
            if lead.engine not in self.baselines:
                raise CellFailed(f"no baseline for {lead.engine}: the baseline engine failed (see its record)")
            step = "correctness"
            self.status(f"{lead.id}: greedy outputs vs the baseline")
            t1 = time.monotonic()
            got, errors = correctness.collect(running.url, self.check_workload(), served,
                                              timeout_s=self.opts.request_timeout_s)
            for cell, rec in zip(cells, recs):
                exact = cell.exact and self.opts.judges_exactly(cell.engine)
                rec["exact"] = exact
                rec["correctness"] = correctness.compare(self.baselines[cell.engine]["check"], got, errors, exact)
                rec["timings"]["correctness_s"] = round(time.monotonic() - t1, 1)
            before = collect(log_dir / "stats", running.url)
            for cell, rec in zip(cells, recs):
                step = self._measure(cell, rec, running, served, log_dir, before)
                before = rec.pop("_after")
                pending.remove(rec)
        except ChildDied as e:
            for rec in pending:
                rec.update(status="failed", reason=f"{e.name} exited with code {e.code} during {rec['step'] or step}",
                           log_tail={e.name: e.tail})
        except CellFailed as e:
            for rec in pending:
                rec.update(status="failed", reason=e.reason,
                           log_tail=e.tails or (running.tails(20) if running else _tails_from(log_dir)))
        except Exception as e:  # noqa: BLE001 - one cell's failure never stops the matrix
            for rec in pending:
                rec.update(status="failed", reason=f"{type(e).__name__} during {rec['step'] or step}: {e}",
                           log_tail=running.tails(20) if running else _tails_from(log_dir),
                           traceback=traceback.format_exc(limit=6))
        finally:
            if running is not None:
                self.status(f"{lead.id}: stopping")
                running.stop()
            for rec in recs:
                rec["timings"]["total_s"] = round(time.monotonic() - t0, 1)
                self._done(rec)

    def _measure(self, cell: Cell, rec: dict[str, Any], running: Running, served: str, log_dir: Path,
                 before: dict[str, Any]) -> str:
        t1 = time.monotonic()
        for i, phase in enumerate(cell.phases):
            rec["step"] = f"load {phase.label}"
            if phase.flush_before:
                flush_prefix_cache(running.plan)
            self.status(f"{cell.id}: load {phase.label} ({phase.num_prompts} requests, "
                        f"{phase.rate if phase.rate != float('inf') else 'all at once'}/s)")
            urls = [w.url for w in running.plan.workers]
            cache0 = prefix_cache_counters(urls)
            rec["phases"].append(run_phase(running.url, phase, self.opts, served, warmup=1 if i == 0 else 0))
            cache1 = prefix_cache_counters(urls)
            queries, hits = cache1["queries"] - cache0["queries"], cache1["hits"] - cache0["hits"]
            rec["phases"][-1]["prefix_cache"] = {"queries": queries, "hits": hits,
                                                 "hit_rate": round(hits / queries, 4) if queries else None}
        rec["timings"]["load_s"] = round(time.monotonic() - t1, 1)
        rec["step"] = "metrics"
        time.sleep(STATS_SETTLE_S)
        after = collect(log_dir / "stats", running.url)
        rec["metrics"] = since(after, before)
        rec["_after"] = after
        failed_requests = sum(p["summary"]["errors"] for p in rec["phases"])
        c = rec["correctness"]
        wrong = c and not c["ok"]
        rec["status"] = "failed" if (failed_requests or wrong) else "ok"
        if wrong:
            rec["reason"] = (f"outputs differ from the baseline: {c['equal']}/{c['expected']} equal"
                             + (f", errors: {c['errors'][:1]}" if c["errors"] else ""))
        elif failed_requests:
            reasons = sorted({r for p in rec["phases"] for r in p["summary"]["error_reasons"]})
            rec["reason"] = f"{failed_requests} load requests failed: {reasons[:2]}"
        if rec["status"] == "failed":
            rec["log_tail"] = running.tails(20)
        rec["step"] = ""
        return "next cell"

    def _done(self, rec: dict[str, Any]) -> dict[str, Any]:
        rec["loadavg_1m"] = round(os.getloadavg()[0], 1)  # a shared machine's load explains slow or failed cells
        if rec.get("group") != "baseline":
            self.record["cells"].append(rec)
        else:
            self.record["baselines"].setdefault(rec["engine"], {}).update(
                status=rec["status"], reason=rec["reason"], log_tail=rec["log_tail"])
        self.save()
        self.on_cell(rec)
        return rec


def new_record(cell: Cell) -> dict[str, Any]:
    return {**cell.describe(), "status": "skipped" if cell.skip else "running", "reason": cell.skip, "step": "",
            "log_tail": {}, "correctness": None, "phases": [], "metrics": None, "timings": {}, "shared_launch": []}


def launch_key(cell: Cell) -> tuple:
    return (cell.engine, cell.prefill, cell.decode, cell.transport, cell.store, cell.tp, cell.variant)


def since(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The counters of `after` minus those of `before` (cells sharing a launch count their own work)."""
    def sub(a, b):
        if isinstance(a, dict):
            return {k: sub(v, (b or {}).get(k)) for k, v in a.items()}
        if isinstance(a, (int, float)) and not isinstance(a, bool) and isinstance(b, (int, float)):
            return type(a)(a - b) if isinstance(a, int) else round(a - b, 6)
        return a

    out = {k: sub(after.get(k), before.get(k)) for k in ("transfer", "store", "router")}
    t = out["transfer"] or {}
    t["gbps"] = round(t["bytes"] / t["seconds"] / 1e9, 3) if t.get("seconds") else None
    return {**out, "workers": after.get("workers"), "per_worker": after.get("per_worker")}


def is_plain(cell: Cell) -> bool:
    return (cell.prefill == 0 and cell.store == "none" and cell.tp == 1 and not cell.variant
            and not cell.scenario and cell.group in ("grid", "seed"))


def _tails_from(log_dir: Path, n: int = 20) -> dict[str, list[str]]:
    out = {}
    for path in sorted(Path(log_dir).glob("*.log")):
        out[path.stem] = path.read_text(errors="replace").splitlines()[-n:]
    return out
