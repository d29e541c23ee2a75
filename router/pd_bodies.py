"""Request bodies for each engine's PD protocol (pure functions; the flow is in orchestrator.py).

vLLM NixlConnector (as vLLM's toy_proxy_server does it):
  prefill: the client's body + kv_transfer_params {do_remote_decode: true, do_remote_prefill: false,
           remote_engine_id/remote_block_ids/remote_host/remote_port: null}, stream false,
           max_tokens 1 (and max_completion_tokens 1 if present), without stream_options,
           min_tokens, min_completion_tokens; header X-Request-Id.
  decode:  the client's body + prefill's returned kv_transfer_params verbatim; same X-Request-Id.
SGLang (as its router's pd_router and mini_lb do it): the same body to both, plus bootstrap_host (prefill's
host, IPv6 bracketed), bootstrap_port (prefill's configured port or null) and a random 63-bit
bootstrap_room (one per prompt of a batch: room + i).
"""

from __future__ import annotations

import copy
import secrets
from typing import Any

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
_PREFILL_DROP = ("stream_options", "min_tokens", "min_completion_tokens")
HINTS_KEY = "pdsdk_hints"


def _without_own_fields(body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    out.pop("pdsdk", None)
    return out


def vllm_prefill_body(body: dict[str, Any], hints: dict[str, Any]) -> dict[str, Any]:
    out = _without_own_fields(body)
    for k in _PREFILL_DROP:
        out.pop(k, None)
    params = dict(PREFILL_PARAMS)
    if hints:
        params[HINTS_KEY] = hints
    out.update(kv_transfer_params=params, stream=False, max_tokens=1)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def vllm_decode_body(body: dict[str, Any], prefill_params: dict[str, Any] | None,
                     hints: dict[str, Any]) -> dict[str, Any]:
    """prefill_params None: serve on decode alone (conditional disaggregation, or a prefill
    worker that returned no params because it has no KV connector)."""
    out = _without_own_fields(body)
    params = dict(prefill_params) if prefill_params else {}
    if hints:
        params[HINTS_KEY] = hints
    if params:
        out["kv_transfer_params"] = params
    else:
        out.pop("kv_transfer_params", None)
    return out


def vllm_plain_body(body: dict[str, Any], hints: dict[str, Any]) -> dict[str, Any]:
    return vllm_decode_body(body, None, hints)


def bracket_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def new_room(batch: int = 1) -> int:
    """Random room in [0, 2^63 - 1], leaving room + i of a batch in range too."""
    return secrets.randbelow((1 << 63) - batch + 1)


def sglang_pd_body(body: dict[str, Any], prefill_host: str, bootstrap_port: int | None,
                   room: int, batch: int, hints: dict[str, Any]) -> dict[str, Any]:
    out = copy.copy(body)
    if hints:
        out["pdsdk"] = hints
    host = bracket_host(prefill_host)
    if batch > 1:
        out.update(bootstrap_host=[host] * batch, bootstrap_port=[bootstrap_port] * batch,
                   bootstrap_room=[room + i for i in range(batch)])
    else:
        out.update(bootstrap_host=host, bootstrap_port=bootstrap_port, bootstrap_room=room)
    return out


def sglang_plain_body(body: dict[str, Any], hints: dict[str, Any]) -> dict[str, Any]:
    out = copy.copy(body)
    if hints:
        out["pdsdk"] = hints
    return out
