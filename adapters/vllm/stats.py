"""PdsdkConnector's stats in vLLM's own connector-stats pipeline.

Each step the worker (and the scheduler) hand vLLM a `PdsdkStats` of what happened since the last
step (`get_kv_connector_stats`); vLLM sums them over TP workers and steps with `aggregate`, logs
`reduce()` every log interval ("KV Transfer metrics: ...") and feeds the raw data to
`PdsdkPromMetrics.observe` for its /metrics endpoint (`vllm:pdsdk_*`). The data is a plain dict
(counters and lists of latencies), because vLLM ships it between processes.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from pdsdk.compat import vllm as compat

_StatsBase, _PromBase = compat.connector_metrics()

# Counters (summed) and per-operation latencies in seconds (concatenated).
COUNTERS = (
    "transfers", "transfer_failures", "transfer_bytes",  # PD pulls (decode side)
    "store_hits", "store_misses", "store_load_bytes", "store_load_failures",  # store loads, in blocks
    "store_saves", "store_save_bytes", "store_save_failures", "store_saves_skipped",  # store saves, in blocks
    "store_lookups", "store_lookup_blocks", "store_lookup_errors",  # scheduler asking a shared store
)
LATENCIES = ("transfer_seconds", "store_load_seconds", "store_lookup_seconds")
# Block hashes whose store saves landed (worker -> scheduler index); taken out before vLLM logs the stats.
SAVED = "store_saved"
MB = 1 << 20


def empty_data() -> dict[str, Any]:
    return {**dict.fromkeys(COUNTERS, 0), **{k: [] for k in LATENCIES + (SAVED,)}}


class PdsdkStats(_StatsBase):
    """vLLM's `KVConnectorStats` for PdsdkConnector: `data` holds COUNTERS and LATENCIES."""

    def __init__(self, data: dict[str, Any] | None = None):
        full = empty_data()
        for k, v in (data or {}).items():
            if k in full:
                full[k] = list(v) if k in LATENCIES + (SAVED,) else v
        super().__init__(data=full)

    def reset(self) -> None:
        self.data = empty_data()

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in COUNTERS + LATENCIES + (SAVED,))

    def aggregate(self, other: Any) -> PdsdkStats:
        data = getattr(other, "data", None) or {}
        for k in COUNTERS:
            self.data[k] += data.get(k, 0)
        for k in LATENCIES + (SAVED,):
            self.data[k].extend(data.get(k, ()))
        return self

    def take_saved(self) -> list[bytes]:
        saved, self.data[SAVED] = self.data[SAVED], []
        return saved

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {}
        if d["transfers"] or d["transfer_failures"]:
            seconds = d["transfer_seconds"]
            out.update({"PD transfers": d["transfers"], "PD failed transfers": d["transfer_failures"],
                        "PD MB": round(d["transfer_bytes"] / MB, 3),
                        "PD avg ms": _ms(sum(seconds) / len(seconds)) if seconds else 0,
                        "PD p90 ms": _ms(_p90(seconds)) if seconds else 0,
                        "PD MB/s": round(d["transfer_bytes"] / MB / sum(seconds), 3) if sum(seconds) else 0})
        if d["store_hits"] or d["store_misses"] or d["store_load_failures"]:
            seconds = d["store_load_seconds"]
            out.update({"Store hit blocks": d["store_hits"], "Store miss blocks": d["store_misses"],
                        "Store failed loads": d["store_load_failures"],
                        "Store loaded MB": round(d["store_load_bytes"] / MB, 3),
                        "Store avg load ms": _ms(sum(seconds) / len(seconds)) if seconds else 0})
        if d["store_saves"] or d["store_save_failures"] or d["store_saves_skipped"]:
            out.update({"Store saved blocks": d["store_saves"], "Store saved MB": round(d["store_save_bytes"] / MB, 3),
                        "Store failed saves": d["store_save_failures"],
                        "Store skipped blocks": d["store_saves_skipped"]})
        if d["store_lookups"] or d["store_lookup_errors"]:
            seconds = d["store_lookup_seconds"]
            out.update({"Store lookups": d["store_lookups"], "Store lookup hit blocks": d["store_lookup_blocks"],
                        "Store lookup errors": d["store_lookup_errors"],
                        "Store avg lookup ms": _ms(sum(seconds) / len(seconds)) if seconds else 0})
        return out


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


class StatsRecorder:
    """Thread-safe accumulator (store saves finish on a thread); `take()` hands over and resets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty_data()

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self._data[k] += v

    def time(self, name: str, seconds: float) -> None:
        with self._lock:
            self._data[name].append(seconds)

    def saved(self, hashes: list[bytes]) -> None:
        with self._lock:
            self._data[SAVED].extend(hashes)

    def take(self) -> PdsdkStats | None:
        """This interval's stats, or None when nothing happened (vLLM skips empty outputs)."""
        with self._lock:
            data, self._data = self._data, empty_data()
        stats = PdsdkStats(data)
        return None if stats.is_empty() else stats


if _PromBase is not None:

    class PdsdkPromMetrics(_PromBase):
        """`vllm:pdsdk_*` on vLLM's /metrics: counters and latency histograms, per engine."""

        BUCKETS: ClassVar[tuple[float, ...]] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
        DOCS: ClassVar[dict[str, str]] = {
            "transfers": "PD KV transfers (pulls) that completed",
            "transfer_failures": "PD KV transfers that failed (recomputed or failed by vLLM)",
            "transfer_bytes": "Bytes moved by PD KV transfers",
            "store_hits": "KV blocks loaded from the pdsdk store",
            "store_misses": "KV blocks the pdsdk store did not have when loading",
            "store_load_bytes": "Bytes loaded from the pdsdk store",
            "store_load_failures": "pdsdk store loads that raised",
            "store_saves": "KV blocks saved to the pdsdk store",
            "store_save_bytes": "Bytes saved to the pdsdk store",
            "store_save_failures": "pdsdk store saves that raised",
            "store_saves_skipped": "KV blocks not saved to the pdsdk store because its save path was full",
            "store_lookups": "Scheduler lookups in a shared pdsdk store",
            "store_lookup_blocks": "KV blocks found by scheduler lookups in a shared pdsdk store",
            "store_lookup_errors": "Scheduler lookups in a shared pdsdk store that failed or were too slow",
        }

        def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self.counters = {k: self._per_engine(self._counter_cls(name=f"vllm:pdsdk_{k}", documentation=doc,
                                                                   labelnames=labelnames))
                             for k, doc in self.DOCS.items()}
            self.histograms = {k: self._per_engine(self._histogram_cls(
                name=f"vllm:pdsdk_{k}", documentation=f"Latency of pdsdk {k.removesuffix('_seconds').replace('_', ' ')}s",
                buckets=list(self.BUCKETS), labelnames=labelnames)) for k in LATENCIES}

        def _per_engine(self, metric: Any) -> dict[int, Any]:
            return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for k, counter in self.counters.items():
                if transfer_stats_data.get(k):
                    counter[engine_idx].inc(transfer_stats_data[k])
            for k, histogram in self.histograms.items():
                for seconds in transfer_stats_data.get(k, ()):
                    histogram[engine_idx].observe(seconds)

else:  # pragma: no cover - a vLLM without per-connector Prometheus metrics
    PdsdkPromMetrics = None
