"""GPU machine: can the matrix's exact greedy check hold on GPUs? Without help a plain engine
disagrees with its own earlier answers (bf16 sums change with the batch and with a warm prefix
cache). This asks vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1) the same questions: one
1P1D `local` launch; the prefill worker asked directly, cold and one by one, then warm and four at
a time; then the same prompts through the router (PD).

Usage: python3 tests/gpu/invariance.py MODEL_DIR   (JSON in $OUT/invariance.json)
"""

import json
import os
import sys
from pathlib import Path

from pdsdk.launch.plan import LaunchOptions, build_plan
from pdsdk.ports import free_port
from pdsdk.launch.supervisor import Supervisor
from pdsdk.matrix import correctness
from pdsdk.matrix.correctness import compare

OUT = Path(os.environ.get("OUT", "/tmp/out"))


def main(model: str) -> None:
    plan = build_plan(LaunchOptions(engine="vllm", model=model, transport="local", gpus=[0, 1], served_name="m",
                                    port=free_port(), engine_args=["--enforce-eager", "--max-model-len", "4096"]))
    for w in plan.workers:
        w.env["VLLM_BATCH_INVARIANT"] = "1"
    sup = Supervisor(plan, OUT / "logs-invariance", echo=False)
    work = correctness.check_workload(vocab=500)
    record: dict = {}
    try:
        for wave in plan.waves:
            sup.start(wave)
            sup.wait_healthy(wave, 300)
        sup.start([plan.router])
        sup.wait_healthy([plan.router], 60)
        engine = plan.workers[0].url
        cold, _ = correctness.collect(engine, work, "m", concurrency=1)
        warm, _ = correctness.collect(engine, work, "m", concurrency=4)
        pd, errors = correctness.collect(plan.router.url, work, "m", concurrency=4)
        record = {"warm_vs_cold": compare(cold, warm), "pd_vs_cold": compare(cold, pd, errors),
                  "pd_vs_warm": compare(warm, pd, errors)}
    finally:
        sup.stop()
    (OUT / "invariance.json").write_text(json.dumps(record, indent=2))
    for name, c in record.items():
        print(f"{name:12} equal {c['equal']}/{c['checked']}  first mismatches {[m['index'] for m in c['mismatches']]}")


if __name__ == "__main__":
    main(sys.argv[1])
