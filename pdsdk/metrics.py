"""Built-in Prometheus metrics: an ordinary observer plugin over the observation hooks.

Metrics live in the default prometheus_client registry, so a process that already exposes
/metrics (vLLM, SGLang, the pdsdk router) shows them with no extra wiring.
"""

from __future__ import annotations

from functools import lru_cache

from prometheus_client import Counter, Histogram

from pdsdk.hookspecs import hookimpl

TRANSFERS = Counter("pdsdk_transfers", "KV transfers by outcome", ["transport", "outcome"])
TRANSFER_BYTES = Counter("pdsdk_transfer_bytes", "KV bytes moved by completed transfers", ["transport", "path"])
TRANSFER_SECONDS = Histogram(
    "pdsdk_transfer_seconds", "Time from post to completion of KV transfers", ["transport"],
    buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10, 30),
)
STORE_PAGES = Counter("pdsdk_store_pages", "KV store page lookups by outcome", ["store", "outcome"])
STORE_HIT_BYTES = Counter("pdsdk_store_hit_bytes", "Bytes served from KV stores", ["store"])
STORE_EVICTIONS = Counter("pdsdk_store_evicted_pages", "Pages evicted or demoted", ["store", "reason"])
ROUTES = Counter("pdsdk_route_decisions", "Router decisions", ["policy", "role"])


@lru_cache(maxsize=4096)
def _child(metric, *labels: str):
    """The labelled series, cached: `labels()` costs more than the increment on the transfer path."""
    return metric.labels(*labels)


@hookimpl
def pdsdk_transfer_started(transport, transfer_id, peer, nbytes, spans):
    _child(TRANSFERS, transport, "started").inc()


@hookimpl
def pdsdk_transfer_finished(transport, transfer_id, peer, nbytes, seconds, path):
    _child(TRANSFERS, transport, "finished").inc()
    _child(TRANSFER_BYTES, transport, path).inc(nbytes)
    _child(TRANSFER_SECONDS, transport).observe(seconds)


@hookimpl
def pdsdk_transfer_failed(transport, transfer_id, peer, reason):
    _child(TRANSFERS, transport, "failed").inc()


@hookimpl
def pdsdk_store_hit(store, pages, nbytes):
    _child(STORE_PAGES, store, "hit").inc(pages)
    _child(STORE_HIT_BYTES, store).inc(nbytes)


@hookimpl
def pdsdk_store_miss(store, pages):
    _child(STORE_PAGES, store, "miss").inc(pages)


@hookimpl
def pdsdk_store_evict(store, pages, nbytes, reason):
    _child(STORE_EVICTIONS, store, reason).inc(pages)


@hookimpl
def pdsdk_route_decision(policy, request_id, role, worker, reason):
    _child(ROUTES, policy, role).inc()
