"""GPU machine: vLLM or SGLang serving configurations one after the other, each through the pdsdk
router: greedy correctness against the engine's single-GPU run, then `pdsdk bench serve` at the
seed's load.

Usage: python3 tests/gpu/serve_tier.py MODEL_DIR CONFIG [CONFIG...]   (configs: see CONFIGS)
Results: $OUT/<config>.json (+ logs); each engine's single-GPU outputs are kept in $HOME/gpu-tier so a
later call (the machine keeps files while warm) compares against them. Stops starting new
configurations when less than PDSDK_GPU_MIN_LEFT seconds of PDSDK_GPU_BUDGET remain.
"""

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdsdk.launch.plan import LaunchOptions, LaunchPlan, build_plan
from pdsdk.ports import free_port
from pdsdk.launch.supervisor import Supervisor
from pdsdk.matrix.loadgen import LoadOptions, run_load, summarize
from pdsdk.matrix.workload import Workload, random_requests

OUT = Path(os.environ.get("OUT", "/tmp/out"))
KEEP = Path.home() / "gpu-tier"
T0 = time.monotonic()
BUDGET = float(os.environ.get("PDSDK_GPU_BUDGET", "570"))
MIN_LEFT = float(os.environ.get("PDSDK_GPU_MIN_LEFT", "150"))
# One-GPU machine (the nvidia-h200 kind): every worker of a configuration sits on GPU 0 with a share
# of its memory, and workers start one after the other (an engine sizes its KV pool from free memory).
ONE_GPU = os.environ.get("PDSDK_GPU_COUNT", "2") == "1"
UTIL = os.environ.get("PDSDK_GPU_UTIL", "0.42" if ONE_GPU else "0.85")
MEM_FRACTION = os.environ.get("PDSDK_GPU_MEM_FRACTION", "0.4" if ONE_GPU else "0.8")
ENGINE_ARGS = {"vllm": ["--gpu-memory-utilization", UTIL, "--max-model-len", "4096"],
               "sglang": ["--mem-fraction-static", MEM_FRACTION, "--context-length", "4096"]}
NUM_PROMPTS, RATE = int(os.environ.get("PDSDK_GPU_PROMPTS", "200")), float(os.environ.get("PDSDK_GPU_RATE", "20"))
MOONCAKE = {"name": "mooncake", "options": {"protocol": os.environ.get("PDSDK_MOONCAKE_PROTOCOL", "nvlink_intra")}}
CONFIGS = {
    "single": dict(prefill=0, decode=1, gpus=[0]),
    # Compiled TP=2 needs vLLM 0.26's allreduce+RMSNorm fusion off (with it the profile run dies with a
    # CUBLAS internal error); the eager run is the fallback.
    "tp2": dict(prefill=0, decode=1, tp=2, gpus=[0, 1], extra=["-cc.pass_config.fuse_allreduce_rms=False"]),
    "tp2-eager": dict(prefill=0, decode=1, tp=2, gpus=[0, 1], extra=["--enforce-eager"]),
    "pd-local": dict(prefill=1, decode=1, gpus=[0, 1], transport="local"),
    "pd-nixl": dict(prefill=1, decode=1, gpus=[0, 1], transport="nixl"),
    "pd-mooncake": dict(prefill=1, decode=1, gpus=[0, 1], transport=MOONCAKE),
    "pd-nccl": dict(prefill=1, decode=1, gpus=[0, 1], transport="nccl"),
    "pd-intree-nixl": dict(prefill=1, decode=1, gpus=[0, 1], native="NixlConnector"),
    # Heterogeneous TP (issue #6): prefill TP=2 on GPUs 0,1, decode TP=1 on GPU 1 (pages sliced by KV
    # head); two engines share GPU 1, so each takes 0.4 of its memory.
    "pd-hetero-tp2-tp1": dict(prefill=1, decode=1, prefill_tp=2, worker_gpus=[[0, 1], [1]], transport="local",
                              extra=["--gpu-memory-utilization", "0.4", "-cc.pass_config.fuse_allreduce_rms=False"]),
    # SGLang 0.5.15.post1: pdsdk as its transfer backend, beside SGLang's own nixl backend.
    "sglang-single": dict(engine="sglang", prefill=0, decode=1, gpus=[0]),
    "sglang-pd-local": dict(engine="sglang", prefill=1, decode=1, gpus=[0, 1], transport="local"),
    "sglang-pd-nixl": dict(engine="sglang", prefill=1, decode=1, gpus=[0, 1], transport="nixl"),
    "sglang-pd-native-nixl": dict(engine="sglang", prefill=1, decode=1, gpus=[0, 1], native="nixl"),
}
# Correctness prompts: token ids (exact lengths) crossing page boundaries in different ways.
CHECK = random_requests(Workload("random", num_prompts=6, isl=700, osl=32, range_ratio=0.9, vocab=500, seed=11))
TIE = 0.05  # a first difference where the single run's top-2 logprobs are this close is rounding, not a bug


def plan_for(name: str, model: str) -> LaunchPlan:
    spec = dict(CONFIGS[name])
    engine, extra, native = spec.pop("engine", "vllm"), spec.pop("extra", []), spec.pop("native", None)
    if ONE_GPU:
        if spec.get("tp", 1) > 1 or spec.get("prefill_tp", 1) > 1:
            raise RuntimeError(f"{name} needs two GPUs (TP=2); this machine has one")
        spec["gpus"] = [0] * len(spec.get("gpus") or [0])
    plan = build_plan(LaunchOptions(engine=engine, model=model, served_name="m", port=free_port(),
                                    engine_args=ENGINE_ARGS[engine] + extra, **spec))
    if native:
        use_native_connector(plan, native)
    return plan


def use_native_connector(plan: LaunchPlan, native: str) -> None:
    """The engine's own PD transfer instead of pdsdk's, behind the same router (it speaks both protocols)."""
    for w in plan.workers:
        if plan.engine == "vllm":
            kv = {"kv_connector": native, "kv_role": "kv_producer" if w.role == "prefill" else "kv_consumer"}
            w.cmd[w.cmd.index("--kv-transfer-config") + 1] = json.dumps(kv)
            w.env.update(VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()), VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1")
        else:
            w.cmd[w.cmd.index("--disaggregation-transfer-backend") + 1] = native


def complete(url: str, prompt: list[int]) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 32, "temperature": 0, "logprobs": 2}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    choice = json.loads(urllib.request.urlopen(req, timeout=300).read())["choices"][0]
    lp = choice["logprobs"]
    gaps = []
    for top in lp["top_logprobs"]:
        vals = sorted((v for v in (top or {}).values()), reverse=True)
        gaps.append(vals[0] - vals[1] if len(vals) > 1 else None)
    return {"text": choice["text"], "tokens": lp["tokens"], "gaps": gaps}


def compare(outputs: list[dict], baseline: list[dict]) -> list[dict]:
    rows = []
    for out, ref in zip(outputs, baseline):
        first = next((i for i, (a, b) in enumerate(zip(out["tokens"], ref["tokens"])) if a != b), None)
        gap = ref["gaps"][first] if first is not None else None
        rows.append({"equal": out["tokens"] == ref["tokens"], "first_difference": first, "baseline_top2_gap": gap,
                     "tie": first is not None and gap is not None and gap < TIE})
    return rows


def run_config(name: str, model: str) -> dict:
    plan = plan_for(name, model)
    sup = Supervisor(plan, OUT / f"logs-{name}", echo=False)
    stats_dir = OUT / f"logs-{name}" / "stats"  # where the supervisor points PDSDK_STATS_DIR
    record: dict = {"config": name, "commands": [w.cmd for w in plan.processes]}
    start = time.monotonic()
    try:
        for wave in plan.waves:  # workers sharing a GPU start one after another
            sup.start(wave)
            sup.wait_healthy(wave, 420)
        sup.start([plan.router])
        sup.wait_healthy([plan.router], 60)
        record["startup_s"] = time.monotonic() - start
        url = f"http://127.0.0.1:{plan.router.port}"
        outputs = [complete(url, r.prompt) for r in CHECK]
        record["outputs"] = outputs
        if name.endswith("single"):
            # The same prompts again hit the prefix cache: the engine then computes only the last
            # partial page on top of cached pages, the order of work a PD decode engine follows.
            KEEP.mkdir(exist_ok=True)
            (KEEP / f"{plan.engine}-baseline.json").write_text(json.dumps(outputs))
            (KEEP / f"{plan.engine}-baseline-warm.json").write_text(json.dumps([complete(url, r.prompt) for r in CHECK]))
        for kind, file in (("correctness", f"{plan.engine}-baseline.json"),
                           ("correctness_warm", f"{plan.engine}-baseline-warm.json")):
            if (KEEP / file).exists():
                record[kind] = compare(outputs, json.loads((KEEP / file).read_text()))
        load = LoadOptions(url, "m", rate=RATE, warmup=4, seed=1)
        results, wall, _ = asyncio.run(run_load(load, Workload("random", num_prompts=NUM_PROMPTS, isl=1024, osl=256,
                                                               vocab=500, seed=1)))
        record["bench"] = summarize(results, wall)
        time.sleep(1)
    except Exception as e:  # noqa: BLE001 - the next configuration still runs
        record["error"] = f"{type(e).__name__}: {e}"
    finally:
        sup.stop()
    record["stats"] = [json.loads(f.read_text()) for f in stats_dir.glob("*.json")] if stats_dir.exists() else []
    record["seconds"] = time.monotonic() - start
    (OUT / f"{name}.json").write_text(json.dumps(record, indent=2))
    return record


def line(rec: dict) -> str:
    b = rec.get("bench")
    if not b:
        return f"{rec['config']:16} ERROR {rec.get('error', '')[:300]}"
    corr = rec.get("correctness") or []
    eq = sum(c["equal"] for c in corr)
    ties = sum(c["tie"] for c in corr)
    warm = sum(c["equal"] for c in rec.get("correctness_warm") or [])
    path = {s.get("path") for s in rec["stats"] if s.get("path")}
    return (f"{rec['config']:16} up {rec['startup_s']:5.0f}s  equal {eq}/{len(corr)} (+{ties} ties, warm {warm})  "
            f"TTFT {b['ttft_ms']['mean']:7.1f}/{b['ttft_ms']['p99']:7.1f}  ITL p99 {b['itl_ms']['p99']:6.1f}  "
            f"tok/s {b['output_throughput']:7.1f}  err {b['errors']}  {','.join(map(str, path))}")


def main() -> None:
    model, names = sys.argv[1], sys.argv[2:]
    OUT.mkdir(parents=True, exist_ok=True)
    unknown = set(names) - set(CONFIGS)
    if unknown:
        sys.exit(f"unknown configs {sorted(unknown)}; valid: {', '.join(CONFIGS)}")
    done = []
    for name in names:
        left = BUDGET - (time.monotonic() - T0)
        if left < MIN_LEFT:
            print(f"skipped {name}: {left:.0f} s left")
            continue
        rec = run_config(name, model)
        done.append(rec)
        print(line(rec), flush=True)
        subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader"])
    print("\n".join(line(r) for r in done))


if __name__ == "__main__":
    main()
