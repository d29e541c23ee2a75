"""GPU machine: prefix reuse through a KV store on the agent workload, one vLLM configuration at a time.

Every configuration serves the same Qwen3-8B-shaped model (dummy weights: the load is what is measured,
the bytes are checked by `pdsdk bench store-path`) with a GPU KV cache of 4000 blocks that the sessions
overflow, and gets the same agent load, then the same random load (no reuse: what a store costs).
Usage: python3 store_sitting.py OUT_DIR MODEL_DIR CONFIG...   CONFIG: none, vllm-offloading,
pdsdk-memory, pdsdk-tiered, shared-redis (two engines, one redis; needs
redis-server on PATH). CAPACITY (bytes, default 60e9) sizes every CPU tier alike; NO_RANDOM=1
skips the random load. Prompt ids stay below 500 (the config-only model's vocabulary is the tokenizer's).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CAPACITY = int(float(os.environ.get("CAPACITY", "60e9")))
AGENT = ["--workload", "agent", "--sessions", "32", "--turns", "6", "--system-tokens", "4096", "--tool-tokens", "1024",
         "--reasoning-tokens", "16", "--osl", "64", "--tool-gap", "2", "--request-rate", "2", "--vocab", "500"]
RANDOM = ["--workload", "random", "--num-prompts", "200", "--isl", "1024", "--osl", "128", "--request-rate", "10", "--vocab", "500"]
ENGINE = ["--max-model-len", "16384", "--num-gpu-blocks-override", "4000", "--load-format", "dummy"]


def kv_config(name: str, tmp: Path) -> dict | None:
    pdsdk = {"kv_connector": "PdsdkConnector", "kv_connector_module_path": "pdsdk.adapters.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    memory = {"name": "memory", "options": {"capacity_bytes": CAPACITY}}
    return {
        "none": None,
        "vllm-offloading": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": {"cpu_bytes_to_use": CAPACITY}},
        "pdsdk-memory": {**pdsdk, "kv_connector_extra_config": {"transport": None, "store": memory}},
        "pdsdk-tiered": {**pdsdk, "kv_connector_extra_config": {"transport": None, "store": {"tiered": [
            {"name": "memory", "options": {"capacity_bytes": CAPACITY // 2}},
            {"name": "disk", "options": {"path": str(tmp / "pages"), "capacity_bytes": CAPACITY}}]}}},
    }[name]


def vllm(model: str, kv: dict | None, extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", "m", *ENGINE, *extra]
    return cmd + ["--kv-transfer-config", json.dumps(kv)] if kv is not None else cmd


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(2)
    raise TimeoutError("the engine is not healthy")


def bench(port: int, args: list[str], out: Path, label: str) -> dict:
    subprocess.run([sys.executable, "-m", "pdsdk", "bench", "serve", "--url", f"http://127.0.0.1:{port}", "--quiet",
                    "--label", label, "--json", str(out), *args], check=False, timeout=400)
    return json.loads(out.read_text())["summary"] if out.exists() else {}


def line(s: dict) -> str:
    t = s.get("ttft_ms") or {}
    return (f"TTFT mean {t.get('mean', float('nan')):.0f} p99 {t.get('p99', float('nan')):.0f} ms, "
            f"{s.get('output_throughput', 0):.0f} tok/s, errors {s.get('errors')}")


class Engine:
    """One server on GPU 0 (`cmd` gets `--port P`), stopped (its process group) on exit; its log kept under OUT."""

    def __init__(self, out: Path, name: str, cmd: list[str], env: dict | None = None):
        from pdsdk.ports import free_port

        self.out, self.name, self.port = out, name, free_port()
        self.log = open(out / f"{name}.log", "w")  # noqa: SIM115 - open while the engine runs
        self.start = time.time()
        self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **(env or {})})

    def ready(self) -> float:
        wait_healthy(self.port, self.proc)
        return time.time() - self.start

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        metrics = [line for line in (self.out / f"{self.name}.log").read_text().splitlines()
                   if "KV Transfer metrics" in line or "Error" in line or "Traceback" in line]
        (self.out / f"{self.name}-metrics.txt").write_text("\n".join(metrics[-40:]))


def one(out: Path, model: str, name: str) -> None:
    tmp = Path(f"/tmp/sitting-{name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    engine = Engine(out, name, vllm(model, kv_config(name, tmp)))
    try:
        started = engine.ready()
        agent = bench(engine.port, AGENT, out / f"{name}.json", name)
        rand = {} if os.environ.get("NO_RANDOM") else bench(engine.port, RANDOM, out / f"{name}-random.json",
                                                             f"{name} random")
        print(f"{name}: start {started:.0f}s | agent {line(agent)} | random {line(rand)}", flush=True)
    finally:
        engine.stop()


def shared_redis(out: Path, model: str) -> None:
    """Two engines on the one GPU share a redis store: A serves the agent sessions, then B serves the
    same sessions (what a router does when it moves them); B's TTFT against the `none` row."""
    from pdsdk.ports import free_port

    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                              "--maxmemory", str(CAPACITY), "--maxmemory-policy", "allkeys-lru"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    store = {"name": "redis", "options": {"url": f"redis://127.0.0.1:{port}/0"}}
    kv = {**kv_config("pdsdk-memory", Path("/tmp")), "kv_connector_extra_config": {"transport": None, "store": store}}
    half = ("--gpu-memory-utilization", "0.42")
    engines = [Engine(out, f"shared-redis-{x}", vllm(model, kv, half)) for x in "ab"]
    try:
        started = [e.ready() for e in engines]
        for e in engines:
            s = bench(e.port, AGENT, out / f"{e.name}.json", e.name)
            print(f"{e.name}: start {started[engines.index(e)]:.0f}s | agent {line(s)}", flush=True)
    finally:
        for e in engines:
            e.stop()
        redis.terminate()
        redis.wait(30)


def main(out: Path, model: str, configs: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in configs:
        try:
            shared_redis(out, model) if name == "shared-redis" else one(out, model, name)
        except Exception as e:  # noqa: BLE001 - report and go on with the next configuration
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
