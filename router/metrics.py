"""Router metrics, in the default prometheus_client registry (so /metrics also shows the
pdsdk_* observer metrics of pdsdk/metrics.py and the process collectors)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
IN_FLIGHT = Gauge("pdsdk_router_in_flight", "Requests in flight per worker", ["worker", "role"])
HEALTHY = Gauge("pdsdk_router_worker_healthy", "1 when the last health check passed", ["worker", "role"])
BREAKER_OPEN = Gauge("pdsdk_router_breaker_open", "1 while the worker's circuit breaker is open",
                     ["worker", "role"])
KV_BLOCKS = Gauge("pdsdk_router_kv_index_blocks", "Blocks in the KV event index per source", ["source"])
KV_EVENTS = Gauge("pdsdk_router_kv_events", "KV event stream counters per source", ["source", "counter"])


_request_children: dict[tuple[str, str], object] = {}


def count_request(route: str, outcome: str) -> None:
    """REQUESTS.labels(route, outcome).inc() with the labelled child cached (hot path)."""
    child = _request_children.get((route, outcome))
    if child is None:
        child = _request_children[(route, outcome)] = REQUESTS.labels(route, outcome)
    child.inc()


def forget_worker(url: str, role: str) -> None:
    for g in (IN_FLIGHT, HEALTHY, BREAKER_OPEN):
        try:
            g.remove(url, role)
        except KeyError:
            pass
