"""Router metrics. Counters and histograms live in the default prometheus_client registry (so
/metrics also shows the pdsdk_* observer metrics of pdsdk/metrics.py and the process collectors);
the workers' gauges are read from the router's state at each scrape (`WorkerGauges`).

With `--processes N`, each process writes its counters to files in PROMETHEUS_MULTIPROC_DIR (set
before prometheus_client is imported) and a scrape of any process sums them all (`scrape`)."""

from __future__ import annotations

import os

from prometheus_client import (CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Histogram,
                               generate_latest)
from prometheus_client.core import GaugeMetricFamily

REQUESTS = Counter("pdsdk_router_requests", "Client requests by route and outcome", ["route", "outcome"])
RETRIES = Counter("pdsdk_router_retries", "Attempts retried on another worker or pair", ["reason"])
LOCAL_PREFILL = Counter("pdsdk_router_local_prefill",
                        "PD requests served by the decode worker alone: reason short_prompt (uncached part below "
                        "the threshold) or no_prefill (no prefill worker usable)", ["reason"])
MISSING_PARAMS = Counter("pdsdk_router_pd_missing_kv_transfer_params",
                         "vLLM prefill responses without kv_transfer_params (no KV connector there?)",
                         ["worker"])
STREAM_CUT = Counter("pdsdk_router_stream_cut", "Streams ended early with an error event after their start: reason "
                     "worker_failed (its connection broke), silent (past --first-token-timeout) or deadline",
                     ["reason"])
CLIENT_CANCELLED = Counter("pdsdk_router_client_cancelled", "Requests whose client went away")
TTFB = Histogram("pdsdk_router_first_byte_seconds", "Router receive to first response byte sent",
                 buckets=(1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10, 30, 100))
DURATION = Histogram("pdsdk_router_request_seconds", "Router receive to last byte sent",
                     buckets=(1e-2, 0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000))

_request_children: dict[tuple[str, str], object] = {}


def count_request(route: str, outcome: str) -> None:
    """REQUESTS.labels(route, outcome).inc() with the labelled child cached (hot path)."""
    child = _request_children.get((route, outcome))
    if child is None:
        child = _request_children[(route, outcome)] = REQUESTS.labels(route, outcome)
    child.inc()


class WorkerGauges:
    """A collector of the router's per-worker gauges, sampled from its state at scrape time."""

    def __init__(self, router):
        self.router = router

    def collect(self):
        labels = ["worker", "role"]
        in_flight = GaugeMetricFamily("pdsdk_router_in_flight", "Requests in flight per worker", labels=labels)
        healthy = GaugeMetricFamily("pdsdk_router_worker_healthy", "1 when the last health check passed",
                                    labels=labels)
        breaker = GaugeMetricFamily("pdsdk_router_breaker_open", "1 while the worker's circuit breaker is open",
                                    labels=labels)
        for w in self.router.pool.workers.values():
            in_flight.add_metric([w.url, w.role], w.load)
            healthy.add_metric([w.url, w.role], 1 if w.healthy else 0)
            breaker.add_metric([w.url, w.role], 1 if w.breaker_state == "open" else 0)
        blocks = GaugeMetricFamily("pdsdk_router_kv_index_blocks", "Blocks in the KV event index per source",
                                   labels=["source"])
        events = GaugeMetricFamily("pdsdk_router_kv_events", "KV event stream counters per source",
                                   labels=["source", "counter"])
        for p in self.router.policies.values():
            st = p.stats()
            for src, n in st.get("blocks", {}).items():
                blocks.add_metric([src], n)
            for src, s in st.get("streams", {}).items():
                for k in ("batches", "blocks", "gaps", "replays", "lost", "restarts", "errors"):
                    events.add_metric([src, k], s.get(k, 0))
        yield from (in_flight, healthy, breaker, blocks, events)


def scrape(router, shared: bool) -> tuple[bytes, str]:
    """The /metrics body and its content type: this process's registry, or (shared) every
    process's counters, plus the workers' gauges."""
    if shared:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, os.environ["PROMETHEUS_MULTIPROC_DIR"])
    else:
        registry = REGISTRY
    gauges = CollectorRegistry(auto_describe=False)
    gauges.register(WorkerGauges(router))
    return generate_latest(registry) + generate_latest(gauges), CONTENT_TYPE_LATEST.split(";")[0]
