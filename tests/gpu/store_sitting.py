"""GPU machine: prefix reuse through a KV store on the agent workload, one vLLM configuration at a time.

Every configuration serves the same Qwen3-8B-shaped model (dummy weights: the load is what is measured,
the bytes are checked by `pdsdk bench store-path`) with a GPU KV cache of 4000 blocks that the sessions
overflow, and gets the same agent load, then the same random load (no reuse: what a store costs).
Usage: python3 store_sitting.py OUT_DIR MODEL_DIR CONFIG...   CONFIG: none, vllm-offloading,
pdsdk-memory, pdsdk-tiered. CAPACITY (bytes, default 60e9) sizes every CPU tier alike; NO_RANDOM=1
skips the random load. Prompt ids stay below 500 (the config-only model's vocabulary is the tokenizer's).
"""

from __future__ import annotations

import json
import os
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


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(2)
    raise TimeoutError("vLLM not healthy")


def bench(port: int, args: list[str], out: Path, label: str) -> dict:
    subprocess.run([sys.executable, "-m", "pdsdk", "bench", "serve", "--url", f"http://127.0.0.1:{port}", "--quiet",
                    "--label", label, "--json", str(out), *args], check=False, timeout=400)
    return json.loads(out.read_text())["summary"] if out.exists() else {}


def line(s: dict) -> str:
    t = s.get("ttft_ms") or {}
    return (f"TTFT mean {t.get('mean', float('nan')):.0f} p99 {t.get('p99', float('nan')):.0f} ms, "
            f"{s.get('output_throughput', 0):.0f} tok/s, errors {s.get('errors')}")


def main(out: Path, model: str, configs: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    from pdsdk.ports import free_port

    for name in configs:
        tmp = Path(f"/tmp/sitting-{name}")
        subprocess.run(["rm", "-rf", str(tmp)])
        tmp.mkdir(parents=True)
        port = free_port()
        cmd = [sys.executable, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", "m", "--port", str(port), *ENGINE]
        kv = kv_config(name, tmp)
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        log = open(out / f"{name}.log", "w")
        start = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(port, proc)
            started = time.time() - start
            agent = bench(port, AGENT, out / f"{name}.json", name)
            rand = {} if os.environ.get("NO_RANDOM") else bench(port, RANDOM, out / f"{name}-random.json",
                                                                 f"{name} random")
            print(f"{name}: start {started:.0f}s | agent {line(agent)} | random {line(rand)}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on with the next configuration
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
            metrics = [line for line in (out / f"{name}.log").read_text().splitlines()
                       if "KV Transfer metrics" in line or "Error" in line or "Traceback" in line]
            (out / f"{name}-metrics.txt").write_text("\n".join(metrics[-40:]))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
