"""Greedy outputs of a cell against the single-engine baseline, token for token.

The fixed prompt set is token ids (exact on every engine and tokenizer), of varied lengths so that
some prompts span many KV pages and some fit in one. Requests go the way the load generator sends
them (streamed, temperature 0, exactly `osl` tokens) with `return_token_ids`, so engines that stream
token ids are compared id by id; others are compared by text.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pdsdk.matrix.loadgen import LoadOptions, Result, run_load
from pdsdk.matrix.workload import Workload

Outputs = dict[int, Any]  # workload index -> token ids (list) or text (str)


def check_workload(vocab: int, num_prompts: int = 8, osl: int = 24) -> Workload:
    """The fixed prompt set: 8 prompts of 10 to 182 tokens (seeded), 24 greedy tokens each."""
    return Workload("random", num_prompts=num_prompts, isl=96, osl=osl, range_ratio=0.9, vocab=vocab, seed=4242)


def output_of(r: Result) -> Any:
    return list(r.token_ids) if r.token_ids is not None else r.text


def load_options(url: str, model: str | None, concurrency: int = 4, rate: float = float("inf"),
                 timeout_s: float = 300.0) -> LoadOptions:
    return LoadOptions(url, model, rate=rate, concurrency=concurrency, warmup=0, timeout_s=timeout_s,
                       keep_output=True, extra_body={"return_token_ids": True})


def collect(url: str, workload: Workload, model: str | None = None, concurrency: int = 4,
            timeout_s: float = 300.0) -> tuple[Outputs, list[str]]:
    """(outputs of the completed requests by index, errors) for `workload` against `url`."""
    results, _, _ = asyncio.run(run_load(load_options(url, model, concurrency, timeout_s=timeout_s), workload))
    return {r.index: output_of(r) for r in results if r.ok}, [r.error for r in results if not r.ok]


def compare(expected: Outputs, got: Outputs, errors: list[str] | None = None, exact: bool = True) -> dict[str, Any]:
    """Summary of `got` against `expected`: how many were checked and equal, and the first mismatches
    (index, position of the first differing token, both sides around it)."""
    mismatches = []
    for index in sorted(got):
        if index not in expected:
            continue
        a, b = expected[index], got[index]
        if a != b:
            pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatches.append({"index": index, "position": pos, "expected": a[max(0, pos - 2):pos + 6],
                               "got": b[max(0, pos - 2):pos + 6]})
    checked = sum(1 for i in got if i in expected)
    by = "token_ids" if any(isinstance(v, list) for v in got.values()) else "text"
    return {"checked": checked, "equal": checked - len(mismatches), "expected": len(expected), "by": by,
            "exact": exact, "errors": list(errors or [])[:5], "mismatches": mismatches[:5],
            "ok": (not exact or not mismatches) and checked == len(expected) and not errors}
