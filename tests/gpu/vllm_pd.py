"""GPU machine: vLLM PD with PdsdkConnector, both instances on one GPU (CUDA IPC through `local`), against
one plain vLLM engine: greedy outputs must be equal. Writes JSON to $OUT. Usage: python3 tests/gpu/vllm_pd.py"""

import json
import os
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from pdsdk.adapters.vllm.command import server_command
from pdsdk.launch.plan import LaunchPlan, ProcessSpec
from pdsdk.ports import free_port
from pdsdk.launch.supervisor import Supervisor
from pdsdk.tinymodel import make_tiny_model

OUT = Path(os.environ.get("OUT", "/tmp/out"))
TRANSPORT = sys.argv[1] if len(sys.argv) > 1 else "local"
PROMPTS = ["Hello, world! How are you today?", "The quick brown fox jumps over the lazy dog. " * 6,
           "Prefill and decode run on different workers. " * 20, "Paris is the capital of France and " * 3]
GPU_ARGS = ("--gpu-memory-utilization", "0.25", "--enforce-eager", "--max-model-len", "2048")


def post(port, body, rid=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": rid or str(uuid.uuid4())})
    return json.loads(urllib.request.urlopen(req, timeout=300).read())


def serve(specs, name):
    plan = LaunchPlan("vllm", "m", "tiny", {}, specs, ProcessSpec("none", "router", [], {}, 0), "127.0.0.1")
    sup = Supervisor(plan, OUT / name, echo=False)
    sup.start(specs)
    sup.wait_healthy(specs, 600)
    return sup


def main():
    model = str(make_tiny_model(OUT / "tiny", hidden=256, heads=4, kv_heads=2))  # head_dim 64
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    port = free_port()
    sup = serve([ProcessSpec("baseline", "worker", server_command(model, port, served_name="tiny", extra_args=GPU_ARGS),
                             env, port)], "baseline")
    try:
        baseline = [post(port, {"model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0})["choices"][0]["text"]
                    for p in PROMPTS]
    finally:
        sup.stop()
    cfg = {"transport": TRANSPORT}
    pp, dp = free_port(), free_port()
    specs = [ProcessSpec("prefill", "prefill", server_command(model, pp, role="prefill", pdsdk_config=cfg,
                                                              served_name="tiny", extra_args=GPU_ARGS), env, pp),
             ProcessSpec("decode", "decode", server_command(model, dp, role="decode", pdsdk_config=cfg,
                                                            served_name="tiny", extra_args=GPU_ARGS),
                         {**env, "PDSDK_STATS_DIR": str(OUT / "stats")}, dp)]
    sup = serve(specs, "pd")
    results = []
    try:
        for p, expected in zip(PROMPTS, baseline):
            rid = str(uuid.uuid4())
            start = time.monotonic()
            first = post(pp, {"model": "tiny", "prompt": p, "max_tokens": 1, "temperature": 0,
                              "kv_transfer_params": {"do_remote_decode": True}}, rid)
            out = post(dp, {"model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0,
                            "kv_transfer_params": first["kv_transfer_params"]}, rid)["choices"][0]["text"]
            results.append({"equal": out == expected, "ms": (time.monotonic() - start) * 1e3, "pd": out,
                            "single": expected, "prompt_tokens": first["usage"]["prompt_tokens"],
                            "blocks": len(first["kv_transfer_params"]["remote_block_ids"])})
        time.sleep(2)
    finally:
        sup.stop()
    stats = [json.loads(f.read_text()) for f in (OUT / "stats").glob("*.json")]
    report = {"transport": TRANSPORT, "results": results, "all_equal": all(r["equal"] for r in results),
              "decode_stats": stats}
    (OUT / f"vllm-pd-{TRANSPORT}.json").write_text(json.dumps(report, indent=2))
    for r in results:
        print(r["equal"], r["prompt_tokens"], r["blocks"], repr(r["pd"][:30]), repr(r["single"][:30]))
    print("decode transport stats:", [{k: s.get(k) for k in ("path", "transfers", "failed", "bytes", "gbps")}
                                      for s in stats])


if __name__ == "__main__":
    main()
