"""Transfer and store metrics of a running cell: the workers' stats files ($PDSDK_STATS_DIR, one JSON
per worker and TP rank, written by the vLLM adapter) and the router's Prometheus /metrics."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

TRANSFER_SUMS = ("transfers", "failed", "bytes", "seconds")
ROUTER_KEEP = ("pdsdk_router_requests_total", "pdsdk_router_retries_total", "pdsdk_router_local_prefill_total",
               "pdsdk_router_pd_missing_kv_transfer_params_total", "pdsdk_router_client_cancelled_total")


def worker_stats(directory: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # being replaced right now; the next read gets it
    return out


def summarize_workers(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Transfers summed over workers (the decode side pulls), the paths bytes took, store counters summed."""
    transfer = {k: 0 for k in TRANSFER_SUMS}
    paths, failures, store = set(), {}, {}
    for s in stats:
        for k in TRANSFER_SUMS:
            transfer[k] += s.get(k) or 0
        if s.get("transfers") and s.get("path"):
            paths.add(str(s["path"]))
        for reason, n in (s.get("failures") or {}).items():
            failures[reason] = failures.get(reason, 0) + n
        for k, v in (s.get("store") or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("capacity"):
                store[k] = store.get(k, 0) + v
    transfer["seconds"] = round(transfer["seconds"], 6)
    transfer["gbps"] = round(transfer["bytes"] / transfer["seconds"] / 1e9, 3) if transfer["seconds"] else None
    transfer["paths"] = sorted(paths)
    transfer["failures"] = failures
    return {"transfer": transfer, "store": store or None, "workers": len(stats)}


def parse_prometheus(text: str, keep: tuple[str, ...] = ROUTER_KEEP) -> dict[str, dict[str, float]]:
    """{metric: {labels: value}} for the metrics in `keep` (the text format, no client library)."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        if name in keep:
            try:
                out.setdefault(name, {})[labels.rstrip("}")] = float(value)
            except ValueError:
                continue
    return out


def router_metrics(url: str) -> dict[str, dict[str, float]]:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as resp:
            return parse_prometheus(resp.read().decode(errors="replace"))
    except OSError as e:
        return {"error": {str(e): 1.0}}


def collect(stats_dir: Path, router_url: str) -> dict[str, Any]:
    stats = worker_stats(stats_dir)
    return {**summarize_workers(stats), "router": router_metrics(router_url), "per_worker": stats}


PREFIX_CACHE = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def prefix_cache_counters(worker_urls: list[str]) -> dict[str, float]:
    """Prompt tokens the workers looked up in their prefix cache and found, summed (vLLM's /metrics)."""
    out = {"queries": 0.0, "hits": 0.0}
    for url in worker_urls:
        m = _scrape(url, PREFIX_CACHE)
        out["queries"] += sum(m.get(PREFIX_CACHE[0], {}).values())
        out["hits"] += sum(m.get(PREFIX_CACHE[1], {}).values())
    return out


def _scrape(url: str, keep: tuple[str, ...]) -> dict[str, dict[str, float]]:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as resp:
            return parse_prometheus(resp.read().decode(errors="replace"), keep)
    except OSError:
        return {}
