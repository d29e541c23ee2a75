"""`pdsdk matrix --faults`: a chaos run. PD (2P2D on GPUs, 1P2D on CPU) with a redis store serves a
stream of requests while faults are injected at random (seeded) times:

- kill_prefill, kill_decode, kill_router: SIGKILL the process group of a prefill worker, a decode
  worker or the router. The launcher (the Supervisor `pdsdk launch` runs) starts it again on its
  port; the router retries requests on the dead worker before their first token and routes around
  it until it is healthy again; decode workers whose pages a dead prefill held recompute them.
  Streams already running on a killed decode worker or router are cut (an error event): reported
  apart. New connections wait in the launcher's listening socket while the router restarts, and
  the load generator, like OpenAI's client, sends again a request whose connection died unanswered.
- stall_prefill: SIGSTOP a prefill worker for 35 s, then SIGCONT: transfers from it stall past their
  deadline (30 s) and are dropped (decode recomputes); the router's health check takes it out of
  rotation meanwhile, and requests already on it finish late, once it runs again. (Shorter than
  the launcher's --unhealthy-timeout, 60 s, which would restart it.)
- store_outage: kill redis-server for a few seconds, then start it again on the same port: the store
  misses and backs off, nothing fails.

One process is faulty at a time (killed and not yet healthy again, or stopped); never the last decode
worker, and with SGLang never the last prefill (a vLLM decode worker serves alone). Every completed
request's greedy output is checked against the single-engine baseline. Reported: requests lost
before their first token, streams cut after it, wrong outputs, requests past the deadline. The goal
is 0 lost, 0 wrong, 0 late.
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

from pdsdk.matrix import correctness
from pdsdk.matrix.cells import Cell, why_not
from pdsdk.matrix.collect import collect
from pdsdk.matrix.loadgen import run_load
from pdsdk.matrix.workload import Workload

KINDS = ("kill_prefill", "kill_decode", "kill_router", "stall_prefill", "store_outage")
FIRST = ("stall_prefill", "store_outage", "kill_decode", "kill_router", "kill_prefill")  # each once, in this order
# Health checks every second, more retries. The first-token (and mid-stream silence) timeout stays long:
# on 2 CPU cores a restarting worker's compile starves the others for tens of seconds.
ROUTER_ARGS = ("--health-interval", "1", "--retries", "4", "--first-token-timeout", "60",
               "--breaker-cooldown", "2")
CLIENT_RETRIES = 2  # OpenAI's client's default max_retries


@dataclass
class FaultOptions:
    requests: int
    rate: float
    deadline_s: float
    transport: str = "nixl"
    engine: str = "vllm"
    prefill: int = 2  # 1 on CPU: three engines share its two cores already
    decode: int = 2
    isl: int = 128
    osl: int = 16
    interval_s: float = 8.0  # mean time between faults
    stall_s: float = 35.0  # longer than the transfer deadline (pdsdk config timeouts.transfer_s, 30 s)
    outage_s: float = 5.0
    seed: int = 0
    kinds: tuple[str, ...] = KINDS  # which faults to inject; none: a control run under the same load


def chaos_workload(f: FaultOptions, vocab: int) -> Workload:
    return Workload("random", num_prompts=f.requests, isl=f.isl, osl=f.osl, range_ratio=0.5, vocab=vocab, seed=777)


class Chaos:
    """The fault injector: a thread that picks a fault at random times; the launcher's Supervisor
    (watching in another thread) brings killed processes back."""

    def __init__(self, running, redis, f: FaultOptions):
        self.sup, self.redis, self.f = running.sup, redis, f
        self.rng = random.Random(f.seed)
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.events: list[dict[str, Any]] = []
        self.faulty: str | None = None  # the process killed and not back yet, or stopped
        self.roles = {role: [w.name for w in running.plan.workers if w.role == role] for role in ("prefill", "decode")}
        self.roles["router"] = [running.plan.router.name]
        self._threads: list[threading.Thread] = []
        self.store_down = False

    def event(self, kind: str, target: str, note: str = "") -> None:
        self.events.append({"t": round(time.monotonic() - self.t0, 1), "kind": kind, "target": target, "note": note})

    def run(self) -> None:
        # Each kind once first, each waiting until no process is faulty, then at random.
        first = [k for k in FIRST if k in self.f.kinds]
        if not first:
            return  # a control run: the same load, no faults
        while not self.stop.wait(self.rng.expovariate(1.0 / self.f.interval_s)):
            if first:
                kind = first.pop(0)
                while kind != "store_outage" and self.faulty is not None:
                    if self.stop.wait(0.5):
                        return
            else:
                kind = self.rng.choice(self.f.kinds)
            getattr(self, kind)()

    def _pick(self, kind: str, role: str) -> str | None:
        """A process of `role` to fault, or None (recorded as skipped): one faulty at a time, never the
        last decode worker, and with SGLang never the last prefill (a vLLM decode worker serves alone)."""
        names = self.roles[role]
        keep = 1 if role == "decode" or (role == "prefill" and self.f.engine != "vllm") else 0
        if self.faulty is not None:
            self.event(kind, "-", f"skipped: {self.faulty} is already down (one at a time)")
        elif len(names) <= keep:
            self.event(kind, "-", f"skipped: it would leave no {role}")
        else:
            self.faulty = self.rng.choice(names)
            return self.faulty
        return None

    def kill_prefill(self) -> None:
        self._kill("kill_prefill", "prefill")

    def kill_decode(self) -> None:
        self._kill("kill_decode", "decode")

    def kill_router(self) -> None:
        self._kill("kill_router", "router")

    def _kill(self, kind: str, role: str) -> None:
        name = self._pick(kind, role)
        if name is None:
            return
        child = self.sup.children[name]
        restarts = child.restarts
        os.killpg(child.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        self.event(kind, name, "SIGKILL")

        def back() -> None:  # the Supervisor restarts it; faulty until it is healthy again
            while not self.stop.wait(0.5):
                if child.restarts > restarts and child.state == "healthy":
                    self.event("restarted", name, f"healthy again {time.monotonic() - killed:.0f} s after the kill")
                    self.faulty = None
                    return
        self._spawn(back)

    def stall_prefill(self) -> None:
        name = self._pick("stall_prefill", "prefill")
        if name is None:
            return
        pid = self.sup.children[name].proc.pid
        os.killpg(pid, signal.SIGSTOP)
        self.event("stall_prefill", name, f"SIGSTOP {self.f.stall_s:.0f}s")

        def resume() -> None:
            self.stop.wait(self.f.stall_s)
            try:
                os.killpg(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.faulty = None
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
        for child in self.sup.children.values():  # nothing stays stopped
            try:
                os.killpg(child.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def run_chaos(runner, f: FaultOptions, status) -> dict[str, Any]:
    from pdsdk.matrix.runner import launch
    from pdsdk.testing.servers import start_redis

    opts = runner.opts
    cell = Cell(f.engine, f.prefill, f.decode, f.transport, "redis", group="faults")
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
        chaos = Chaos(running, redis, f)
        workload = chaos_workload(f, opts.vocab)
        load = correctness.load_options(running.url, running.plan.served_name, concurrency=0, rate=f.rate,
                                        timeout_s=f.deadline_s * 2)
        load.warmup, load.retries = 1, CLIENT_RETRIES

        def keep_up() -> None:  # what `pdsdk launch` does once ready: restart what dies
            try:
                running.sup.watch()
            except Exception as e:  # noqa: BLE001 - reported
                out["error"] = f"the launcher gave up: {e}"
        threading.Thread(target=keep_up, daemon=True).start()
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
        out["client_retries"] = sum(r.retries for r in results)
        out["restarts"] = {name: c.restarts for name, c in running.sup.children.items() if c.restarts}
        out["duration_s"] = round(wall, 1)
        out["events"] = chaos.events
        counts: dict[str, int] = {}
        for e in chaos.events:
            if "skipped" not in e["note"] and e["kind"] != "restarted":
                counts[e["kind"]] = counts.get(e["kind"], 0) + 1
        out["fault_counts"] = counts
        time.sleep(1.5)
        metrics = collect(log_dir / "stats", running.url)
        out["router_retries"] = sum((metrics["router"].get("pdsdk_router_retries_total") or {}).values())
        out["transfer"] = metrics["transfer"]
        out["store"] = metrics["store"]
        out["exact"] = opts.judges_exactly(f.engine)  # else different outputs are reported, not judged
        out["ok"] = (out["lost"] == 0 and out["late"] == 0 and (out["wrong"] == 0 or not out["exact"])
                     and (bool(counts) or not f.kinds) and "error" not in out)
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
    """Lost (failed before its first token, or a stream that ended early with no error: its output a
    strict prefix of the baseline's), cut (failed after its first token: an error event, or the
    connection closed), wrong (completed with an output that differs from the baseline's) and late
    (completed after the deadline) requests, with the first examples of each."""
    lost, cut, ok, wrong, reasons, cut_reasons = [], [], [], [], set(), set()
    for r in results:
        got, want = correctness.output_of(r), expected.get(r.index)
        if not r.ok:
            (cut if r.ttft_s > 0 else lost).append(r)
            (cut_reasons if r.ttft_s > 0 else reasons).add(r.error)
        elif got != want and want is not None and len(got) < len(want) and list(want[:len(got)]) == list(got):
            lost.append(r)
            reasons.add(f"stream ended after {len(got)} of {len(want)} tokens without an error event")
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
    return {"completed": len(ok), "lost": len(lost), "cut": len(cut), "wrong": len(wrong), "late": len(late),
            "checked": len(ok), "lost_reasons": sorted(reasons)[:5], "cut_reasons": sorted(cut_reasons)[:5],
            "wrong_examples": examples, "e2e_ms_max": round(max((r.e2e_s for r in ok), default=0) * 1e3, 1)}
