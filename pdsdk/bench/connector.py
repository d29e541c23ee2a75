"""`pdsdk bench connector`: PdsdkConnector against vLLM's in-tree NixlConnector, same machine, same
prompts, same PD protocol: TTFT, end-to-end latency and output throughput, and their ratios.

Both pairs run one after the other with identical settings (prefill on the first cores, decode on
the rest); requests go prefill (max_tokens 1) then decode (streamed), as NixlConnector's proxy does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pdsdk.bench.log import append_rows, write_json


def register(sub) -> None:
    p = sub.add_parser("connector", help="PdsdkConnector vs vLLM's NixlConnector: TTFT and throughput",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the tiny local model)")
    p.add_argument("--transport", default="nixl", help="PdsdkConnector's transport (default nixl)")
    p.add_argument("--requests", type=int, default=24, help="requests per connector (default 24)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--isl", type=int, default=256, help="prompt length in tokens, roughly (default 256)")
    p.add_argument("--osl", type=int, default=32, help="output tokens (default 32)")
    p.add_argument("--gpus", default=None, help="prefill GPU,decode GPU (default: CPU)")
    p.add_argument("--json", dest="json_out", help="write the records to this file")
    p.add_argument("--doc", default="", help="markdown file to append rows to (e.g. docs/benchmarks.md; default: none)")
    p.set_defaults(func=run)


def connector_configs(transport: str) -> dict[str, dict[str, Any]]:
    from pdsdk.adapters.vllm.command import kv_transfer_config

    return {
        "PdsdkConnector": {role: kv_transfer_config(role, {"transport": transport}) for role in ("prefill", "decode")},
        "NixlConnector": {role: {"kv_connector": "NixlConnector", "kv_role": kv, "kv_buffer_device": "cpu",
                                 "kv_load_failure_policy": "recompute"}
                          for role, kv in (("prefill", "kv_producer"), ("decode", "kv_consumer"))},
    }


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from pdsdk.tinymodel import make_tiny_model

    console = Console()
    work = Path(tempfile.mkdtemp(prefix="pdsdk-bench-connector-"))
    model = args.model or str(make_tiny_model(work / "tiny"))
    prompts = [(f"request {i}: " + "the quick brown fox jumps over the lazy dog " * (args.isl // 10))
               for i in range(args.requests)]
    records = []
    for name, roles in connector_configs(args.transport).items():
        console.print(f"[bold]{name}[/]: starting prefill and decode...")
        records.append(_bench_pair(name, roles, model, prompts, args, work / name, console))
    base = next(r for r in records if r["connector"] == "NixlConnector")
    for r in records:
        r["throughput_ratio"] = round(r["output_tok_s"] / base["output_tok_s"], 3)
        r["ttft_ratio"] = round(base["ttft_mean_ms"] / r["ttft_mean_ms"], 3)  # > 1: faster than NixlConnector
    table = Table(title=f"PD 1P1D, {args.requests} requests, concurrency {args.concurrency}, ~{args.isl}/{args.osl} tokens")
    for col in ("connector", "TTFT mean ms", "TTFT p50", "E2E mean ms", "output tok/s", "x NixlConnector tok/s",
                "x NixlConnector TTFT", "errors"):
        table.add_column(col)
    for r in records:
        table.add_row(r["connector"], f"{r['ttft_mean_ms']:.1f}", f"{r['ttft_p50_ms']:.1f}", f"{r['e2e_mean_ms']:.1f}",
                      f"{r['output_tok_s']:.1f}", f"{r['throughput_ratio']:.2f}", f"{r['ttft_ratio']:.2f}",
                      str(r["errors"]))
    console.print(table)
    write_json(args.json_out, records)
    if args.doc and Path(args.doc).exists():
        rows = [[r["connector"] + (f" ({args.transport})" if r["connector"] == "PdsdkConnector" else ""),
                 f"{args.requests} x ~{args.isl}/{args.osl}, c={args.concurrency}", f"{r['ttft_mean_ms']:.1f}",
                 f"{r['output_tok_s']:.1f}", f"{r['throughput_ratio']:.2f}", f"{r['ttft_ratio']:.2f}"]
                for r in records]
        append_rows(args.doc, "vLLM connectors (`pdsdk bench connector`)", rows)
    return 0 if all(r["errors"] == 0 for r in records) else 1


def _bench_pair(name: str, roles: dict, model: str, prompts: list[str], args, log_dir: Path, console) -> dict:
    from pdsdk.adapters.vllm.command import server_command
    from pdsdk.launch.plan import LaunchPlan, ProcessSpec, placements
    from pdsdk.ports import free_port
    from pdsdk.launch.supervisor import Supervisor

    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
    slots = placements(2, 1, gpus)
    workers = []
    for (role, kv), placement in zip(roles.items(), slots):
        port, side = free_port(), free_port()
        extra = ["--kv-transfer-config", json.dumps(kv)] + ([] if gpus else ["--block-size", "32"])
        env = {**placement, "UCX_TLS": "tcp,cma,self", "VLLM_HOST_IP": "127.0.0.1",
               "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
        workers.append(ProcessSpec(f"{name}-{role}", role, server_command(model, port, served_name="tiny",
                                                                          max_model_len=2048, extra_args=tuple(extra)),
                                   env, port))
    plan = LaunchPlan("vllm", model, "tiny", {}, workers, ProcessSpec("none", "router", [], {}, 0), "127.0.0.1")
    sup = Supervisor(plan, log_dir, console, echo=False)
    try:
        sup.start(workers)
        sup.wait_healthy(workers, 900)
        prefill, decode = workers
        _one(prefill.url, decode.url, prompts[0], args.osl)  # warm-up: connections, caches
        start = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda p: _one(prefill.url, decode.url, p, args.osl), prompts))
        wall = time.monotonic() - start
    finally:
        sup.stop()
    ok = [r for r in results if r is not None]
    ttft = [r[0] for r in ok] or [float("nan")]
    return {"connector": name, "requests": len(prompts), "errors": len(prompts) - len(ok),
            "ttft_mean_ms": statistics.mean(ttft) * 1e3, "ttft_p50_ms": statistics.median(ttft) * 1e3,
            "e2e_mean_ms": statistics.mean([r[1] for r in ok] or [float("nan")]) * 1e3,
            "output_tok_s": sum(r[2] for r in ok) / wall, "wall_s": wall}


def _one(prefill: str, decode: str, prompt: str, osl: int) -> tuple[float, float, int] | None:
    """(TTFT, end-to-end seconds, output tokens) of one PD request, or None on error."""
    rid = str(uuid.uuid4())
    start = time.monotonic()
    try:
        first = _post(prefill, {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": False,
                                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                                       "remote_engine_id": None, "remote_block_ids": None,
                                                       "remote_host": None, "remote_port": None}}, rid)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": osl, "min_tokens": osl, "temperature": 0,
                "stream": True, "ignore_eos": True, "kv_transfer_params": json.loads(first)["kv_transfer_params"]}
        ttft, tokens = None, 0
        req = urllib.request.Request(f"{decode}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "X-Request-Id": rid})
        with urllib.request.urlopen(req, timeout=300) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    ttft = ttft if ttft is not None else time.monotonic() - start
                    tokens += 1
        return ttft or 0.0, time.monotonic() - start, tokens
    except Exception:  # noqa: BLE001 - counted as an error, not a crash of the whole bench
        return None


def _post(base: str, body: dict, rid: str) -> bytes:
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": rid})
    return urllib.request.urlopen(req, timeout=300).read()
