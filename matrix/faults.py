"""`pdsdk matrix --faults`: a chaos run. PD with two prefill workers and a redis store serves a
stream of requests while faults are injected at random (seeded) times:

- kill_prefill: SIGKILL a prefill worker's process group (through the Supervisor's process), then start
  it again on the same port (on GPUs; on CPU it stays dead: its restart would compile for minutes on the
  cores the others serve from); requests on it fail over (the router retries before the first token) and
  decode workers whose pages it held recompute them.
- stall_prefill: SIGSTOP a prefill worker for 35 s, then SIGCONT: transfers from it stall past their
  deadline (30 s) and are dropped (decode recomputes); the router's health check takes it out of
  rotation meanwhile, and requests already on it finish late, once it runs again.
- store_outage: kill redis-server for a few seconds, then start it again on the same port: the store
  misses and backs off, nothing fails.

At most one prefill is faulty at a time. With vLLM the last healthy prefill may be faulted too: the
router then has the decode worker serve alone (it prefills itself); SGLang always keeps one. On CPU
the run is 1P1D: three vLLM engines on two cores starve each other (each engine's worker busy-polls
its step queue for a second after every step), which tests the machine, not pdsdk. Every completed
request's greedy output is checked against the single-engine baseline. Reported: lost requests
(never completed), wrong outputs, requests past the deadline. The goal is 0, 0, 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from pdsdk.launch.plan import ProcessSpec
from pdsdk.matrix import correctness
from pdsdk.matrix.cells import Cell, why_not
from pdsdk.matrix.collect import collect
from pdsdk.matrix.loadgen import run_load
from pdsdk.matrix.workload import Workload

KINDS = ("kill_prefill", "stall_prefill", "store_outage")
# Health checks every second, more retries. The first-token (and mid-stream silence) timeout stays long:
# on 2 CPU cores a restarting worker's compile starves the decode worker for tens of seconds.
ROUTER_ARGS = ("--health-interval", "1", "--retries", "4", "--first-token-timeout", "60",
               "--breaker-cooldown", "2")


@dataclass
class FaultOptions:
    requests: int
    rate: float
    deadline_s: float
    transport: str = "nixl"
    engine: str = "vllm"
    prefill: int = 2  # 1 on CPU (see above)
    isl: int = 128
    osl: int = 16
    interval_s: float = 8.0  # mean time between faults
    stall_s: float = 35.0  # longer than the transfer deadline (pdsdk config timeouts.transfer_s, 30 s)
    outage_s: float = 5.0
    seed: int = 0
    kinds: tuple[str, ...] = KINDS  # which faults to inject; none: a control run under the same load
    restart: bool = True  # start a killed prefill again (on 2 CPU cores its compile starves the rest for minutes)


def chaos_workload(f: FaultOptions, vocab: int) -> Workload:
    return Workload("random", num_prompts=f.requests, isl=f.isl, osl=f.osl, range_ratio=0.5, vocab=vocab, seed=777)


class Chaos:
    """The fault injector: a thread that picks a fault at random times and undoes it after a while."""

    def __init__(self, running, redis, f: FaultOptions, start_timeout_s: float, status):
        self.running, self.redis, self.f = running, redis, f
        self.start_timeout_s, self.status = start_timeout_s, status
        self.rng = random.Random(f.seed)
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.events: list[dict[str, Any]] = []
        self.faulty: set[str] = set()  # prefill names being killed/restarted or stalled
        self.current = {s.name: s for s in running.plan.workers if s.role == "prefill"}  # name -> live spec
        self.restarts = 0
        self._threads: list[threading.Thread] = []
        self.store_down = False

    def event(self, kind: str, target: str, note: str = "") -> None:
        self.events.append({"t": round(time.monotonic() - self.t0, 1), "kind": kind, "target": target, "note": note})

    def run(self) -> None:
        # Each kind once first, each waiting until it can run (a stalled or restarting prefill is never
        # joined by the other: one must serve), then at random. A killed worker takes minutes to come
        # back on CPU, so it goes last.
        first = [k for k in ("stall_prefill", "store_outage", "kill_prefill") if k in self.f.kinds]
        if not first:
            return  # a control run: the same load, no faults
        while not self.stop.wait(self.rng.expovariate(1.0 / self.f.interval_s)):
            if first:
                kind = first.pop(0)
                while kind.endswith("_prefill") and len(self._healthy_prefills()) < len(self.current):
                    if self.stop.wait(0.5):
                        return
            else:
                kind = self.rng.choice(self.f.kinds)
            getattr(self, kind)()

    def _healthy_prefills(self) -> list[str]:
        return [n for n in self.current if n not in self.faulty]

    def _pick(self, kind: str) -> str | None:
        up = self._healthy_prefills()
        keep = 0 if self.f.engine == "vllm" else 1  # a vLLM decode worker can serve alone; SGLang's cannot
        if len(up) < len(self.current) or len(up) <= keep:
            self.event(kind, "-", "skipped: a prefill is already down (one at a time)" if len(up) < len(self.current)
                       else "skipped: it would leave no prefill worker")
            return None
        return self.rng.choice(up)

    def _proc(self, name: str):
        return self.running.sup.procs[self.current[name].name]

    def kill_prefill(self) -> None:
        name = self._pick("kill_prefill")
        if name is None:
            return
        self.faulty.add(name)
        os.killpg(self._proc(name).pid, signal.SIGKILL)
        self.event("kill_prefill", name, "SIGKILL" + ("" if self.f.restart else ", not restarted"))
        if self.f.restart:
            self._spawn(self._restart, name)

    def _restart(self, name: str) -> None:
        time.sleep(1.0)
        self.restarts += 1
        spec: ProcessSpec = dataclasses.replace(self.current[name], name=f"{name}.r{self.restarts}")
        self.current[name] = spec
        self.running.sup.start([spec])
        deadline = time.monotonic() + self.start_timeout_s
        from pdsdk.matrix.runner import answers

        while not self.stop.is_set() and time.monotonic() < deadline:
            if self.running.sup.procs[spec.name].poll() is not None:
                self.event("restart_failed", name, f"exited with {self.running.sup.procs[spec.name].returncode}")
                return
            if answers(spec.url + spec.health_path):
                self.event("restarted", name, f"healthy again as {spec.name}")
                self.faulty.discard(name)
                return
            time.sleep(0.5)

    def stall_prefill(self) -> None:
        name = self._pick("stall_prefill")
        if name is None:
            return
        self.faulty.add(name)
        pid = self._proc(name).pid
        os.killpg(pid, signal.SIGSTOP)
        self.event("stall_prefill", name, f"SIGSTOP {self.f.stall_s:.0f}s")

        def resume() -> None:
            self.stop.wait(self.f.stall_s)
            try:
                os.killpg(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.faulty.discard(name)
        self._spawn(resume)

    def store_outage(self) -> None:
        if self.redis is None or self.store_down:
            return
        self.store_down = True
        self.redis.kill()
        self.event("store_outage", f"redis:{self.redis.port}", f"down {self.f.outage_s:.0f}s")

        def back() -> None:
            self.stop.wait(self.f.outage_s)
            self.redis.start()
            self.store_down = False
        self._spawn(back)

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def finish(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(30)
        for name in self.current:  # nothing stays stopped
            try:
                os.killpg(self._proc(name).pid, signal.SIGCONT)
            except (ProcessLookupError, KeyError):
                pass


def run_chaos(runner, f: FaultOptions, status) -> dict[str, Any]:
    from pdsdk.connectors.stores.servers import start_redis
    from pdsdk.matrix.runner import launch

    opts = runner.opts
    cell = Cell(f.engine, f.prefill, 1, f.transport, "redis", group="faults")
    out: dict[str, Any] = {"cell": cell.id, "requests": f.requests, "rate": f.rate, "deadline_s": f.deadline_s,
                           "options": dataclasses.asdict(f), "ok": False}
    reason = why_not(cell, opts.gpus)
    expected = runner.baselines.get(f.engine, {}).get("faults")
    if reason or expected is None:
        out["error"] = reason or f"no baseline outputs for {f.engine} (the baseline engine failed)"
        return out
    log_dir = opts.out / "logs" / "faults"
    log_dir.mkdir(parents=True, exist_ok=True)
    redis = start_redis(log_dir)
    store = {"name": "redis", "options": {"url": f"redis://127.0.0.1:{redis.port}/0", "timeout_s": 0.5}}
    running = chaos = None
    t0 = time.monotonic()
    try:
        running = launch(cell, opts, log_dir, status, router_args=ROUTER_ARGS, store=store)
        out["start_s"] = round(time.monotonic() - t0, 1)
        chaos = Chaos(running, redis, f, opts.start_timeout_s, status)
        workload = chaos_workload(f, opts.vocab)
        load = correctness.load_options(running.url, running.plan.served_name, concurrency=0, rate=f.rate,
                                        timeout_s=f.deadline_s * 2)
        load.warmup = 1
        done = [0]

        def progress(res) -> None:
            done[0] += 1
            status(f"chaos: {done[0]}/{f.requests} requests, faults so far: {len(chaos.events)}")

        injector = threading.Thread(target=chaos.run, daemon=True)
        injector.start()
        results, wall, _ = asyncio.run(run_load(load, workload, progress))
        chaos.finish()
        injector.join(5)
        out.update(judge(results, expected, f.deadline_s))
        out["duration_s"] = round(wall, 1)
        out["events"] = chaos.events
        counts: dict[str, int] = {}
        for e in chaos.events:
            if "skipped" not in e["note"]:
                counts[e["kind"]] = counts.get(e["kind"], 0) + 1
        out["fault_counts"] = counts
        time.sleep(1.5)
        metrics = collect(log_dir / "stats", running.url)
        out["router_retries"] = sum((metrics["router"].get("pdsdk_router_retries_total") or {}).values())
        out["transfer"] = metrics["transfer"]
        out["store"] = metrics["store"]
        out["exact"] = opts.judges_exactly(f.engine)  # else different outputs are reported, not judged
        out["ok"] = (out["lost"] == 0 and out["late"] == 0 and (out["wrong"] == 0 or not out["exact"])
                     and (bool(counts) or not f.kinds))
    except Exception as e:  # noqa: BLE001 - reported, never raised
        out["error"] = f"{type(e).__name__}: {e}"
        if running is not None:
            out["log_tail"] = running.tails(20)
    finally:
        if chaos is not None:
            chaos.finish()
        if running is not None:
            running.stop()
        redis.stop()
    out["total_s"] = round(time.monotonic() - t0, 1)
    out["loadavg_1m"] = round(os.getloadavg()[0], 1)
    return out


def judge(results, expected: dict[int, Any], deadline_s: float) -> dict[str, Any]:
    """Lost (never completed, or a stream cut short: its output a strict prefix of the baseline's), wrong
    (completed with an output that differs from the baseline's) and late (completed after the deadline)
    requests, with the first examples of each."""
    lost, ok, wrong, reasons = [], [], [], set()
    for r in results:
        got, want = correctness.output_of(r), expected.get(r.index)
        if not r.ok:
            lost.append(r)
            reasons.add(r.error)
        elif got != want and want is not None and len(got) < len(want) and list(want[:len(got)]) == list(got):
            lost.append(r)
            reasons.add(f"stream cut after {len(got)} of {len(want)} tokens")
        else:
            ok.append(r)
            if got != want:
                wrong.append(r)
    late = [r for r in ok if r.e2e_s > deadline_s]
    examples = []
    for r in wrong[:3]:
        got, want = correctness.output_of(r), expected.get(r.index) or []
        pos = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
        examples.append({"index": r.index, "position": pos, "expected": want[max(0, pos - 2):pos + 6],
                         "got": got[max(0, pos - 2):pos + 6], "lengths": [len(want), len(got)]})
    return {"completed": len(ok), "lost": len(lost), "wrong": len(wrong), "late": len(late),
            "checked": len(ok), "lost_reasons": sorted(reasons)[:5], "wrong_examples": examples,
            "e2e_ms_max": round(max((r.e2e_s for r in ok), default=0) * 1e3, 1)}
