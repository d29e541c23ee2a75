"""What differs between the SGLang versions pdsdk supports: 0.5.15.post1 (the GPU machine, torch
2.11) and 0.5.23 (CI). The SGLang adapter asks here instead of probing APIs itself
(each function names the version that moved the API).

Nothing here imports SGLang at module import: `pdsdk doctor` and the command builder use it on
machines without SGLang.
"""

from __future__ import annotations

import inspect
import logging
from functools import lru_cache
from typing import Any

from packaging.version import Version

from pdsdk.compat.versions import installed

log = logging.getLogger(__name__)
BACKEND = "pdsdk"  # the --disaggregation-transfer-backend name pdsdk adds


def version() -> str | None:
    found = installed("sglang")
    return found.version if found else None


def support() -> tuple[bool, str]:
    """(supported, one line for `pdsdk doctor`)."""
    found = installed("sglang")
    if found is None:
        return False, "not installed"
    c = found.component
    if not found.supported:
        return False, f"{found.version} is outside {c.supported} (tested: {', '.join(c.tested)})"
    if Version(found.version) < Version("0.5.15"):
        return False, f"{found.version} has no sglang.srt.plugins entry points (needs >= 0.5.15)"
    return True, f"{found.version}: transfer backend {BACKEND!r} and HiCache storage via 'dynamic'"


def check_supported() -> None:
    """Warn once at backend start when the installed SGLang is outside the tested range."""
    ok, detail = support()
    if not ok:
        log.warning("pdsdk: SGLang %s; the pdsdk backend may not work", detail)


def at_least(v: str) -> bool:
    current = version()
    return current is not None and Version(current) >= Version(v)


# --- disaggregation -----------------------------------------------------------------------------

def kv_status_frames_carry_reason() -> bool:
    """0.5.23's decode side parses `[tag, room, status, rank, reason]` status frames itself; 0.5.15
    has no such parser. pdsdk's backend brings its own parser, so this is informational."""
    return at_least("0.5.21")


@lru_cache(maxsize=None)
def sender_init_params() -> tuple[str, ...]:
    """Parameter names of CommonKVSender.__init__ after `mgr, bootstrap_addr, bootstrap_room`:
    0.5.15 `(dest_tp_ranks, pp_rank)`; 0.5.22+ `(req_has_disagg_prefill_dp_rank=False)`."""
    from sglang.srt.disaggregation.common.conn import CommonKVSender

    names = list(inspect.signature(CommonKVSender.__init__).parameters)
    return tuple(names[4:])


def network_address(host: str, port: int) -> Any:
    """SGLang's NetworkAddress (0.5.10+; both supported versions have it in utils.network)."""
    from sglang.srt.utils.network import NetworkAddress

    return NetworkAddress(host, port)


def local_ip() -> str:
    """The address SGLang's managers bind their ZMQ sockets to (utils.network since 0.5.10)."""
    try:
        from sglang.srt.utils.network import get_local_ip_auto
    except ImportError:  # <= 0.5.9
        from sglang.srt.utils import get_local_ip_auto
    return get_local_ip_auto()


def decode_allocation_policy(mgr: Any) -> str:
    """0.5.23 may defer decode allocation until prefill completes; 0.5.15 always allocates early."""
    return "prefill_complete" if getattr(mgr, "defer_decode_allocation", False) else "early"


def publish_standalone(server_args: Any, *, tp_rank: int = 0) -> None:
    """Make a process look enough like a scheduler for SGLang's KV managers to be built outside
    one (tests, tools): 0.5.16+ reads parallel sizes and flags from `runtime_context`, which the
    scheduler publishes; 0.5.15 reads `server_args` and the dp-attention globals."""
    try:
        from sglang.srt.runtime_context import SpawnRanks, publish
    except ImportError:  # 0.5.15: the manager asks dp_attention's getters, which need process groups
        from sglang.srt.disaggregation.common import conn

        tp = getattr(server_args, "tp_size", 1)
        for name, value in (("get_attention_tp_rank", tp_rank), ("get_attention_tp_size", tp),
                            ("get_attention_cp_rank", 0), ("get_attention_cp_size", 1),
                            ("get_attention_dp_rank", 0), ("get_attention_dp_size", 1)):
            setattr(conn, name, lambda value=value: value)
        conn.get_pp_group = lambda: None
        return
    from sglang.srt.runtime_context import get_parallel

    publish(server_args, role="test", ranks=SpawnRanks(world_rank=tp_rank, dp_rank=None, gpu_id=None))
    get_parallel().override_permanently(pp_group=None)  # no process groups: PP=1


# --- HiCache ------------------------------------------------------------------------------------

def storage_config(**fields: Any) -> Any:
    """A HiCacheStorageConfig from the fields this version knows (0.5.21 added dp_rank, 0.5.23
    dcp_size/dcp_rank/logical_page_size); unknown ones are dropped, missing ones defaulted."""
    from dataclasses import fields as dc_fields

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    known = {f.name for f in dc_fields(HiCacheStorageConfig)}
    defaults = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0, "attn_cp_size": 1,
                "is_mla_model": False, "enable_storage_metrics": False, "is_page_first_layout": True,
                "model_name": None}
    values = {**defaults, **fields}
    return HiCacheStorageConfig(**{k: v for k, v in values.items() if k in known})


def storage_metrics_class() -> Any:
    """StorageMetrics moved from metrics.collector to observability.metrics_collector (0.5.10)."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ImportError:
        from sglang.srt.metrics.collector import StorageMetrics
    return StorageMetrics


# --- KV events ----------------------------------------------------------------------------------

def kv_event_encoding(v: str | None = None) -> str:
    """"array" (positional msgpack arrays, <= 0.5.15) or "map" (tagged maps, >= 0.5.20): the wire
    format of SGLang's KV events (disaggregation/kv_events.py)."""
    v = v or version()
    if v is None:
        return "map"
    return "array" if Version(v) < Version("0.5.16") else "map"
