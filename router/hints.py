"""L6 hints on a request: priority, ttl_s, pin, session, keep (the store's `Hints`).

Accepted from, later ones winning:
1. Dynamo's `nvext.agent_hints` (`priority`; `prefix_id` is its affinity key, used as the session),
2. the `pdsdk` body field: {"priority", "ttl_s", "pin", "session", "keep"},
3. headers X-Pdsdk-Priority, X-Pdsdk-Ttl, X-Pdsdk-Pin, X-Pdsdk-Session (or X-Session-Id), X-Pdsdk-Keep.
Passed on to the workers: for vLLM inside `kv_transfer_params` under "pdsdk_hints" (the field
that reaches the KV connector); for SGLang as the normalized `pdsdk` body field.
"""

from __future__ import annotations

from typing import Any, Mapping

FIELDS = ("priority", "ttl_s", "pin", "session", "keep")
HEADERS = {"x-pdsdk-priority": "priority", "x-pdsdk-ttl": "ttl_s", "x-pdsdk-pin": "pin",
           "x-pdsdk-session": "session", "x-session-id": "session", "x-pdsdk-keep": "keep"}


class HintError(ValueError):
    pass


def _bool(v: Any, name: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("1", "true", "yes", "0", "false", "no"):
        return v.lower() in ("1", "true", "yes")
    if isinstance(v, int):
        return bool(v)
    raise HintError(f"{name} must be a boolean, got {v!r}")


def _coerce(name: str, v: Any) -> Any:
    try:
        if name == "priority":
            return int(v)
        if name == "ttl_s":
            return None if v is None else float(v)
        if name in ("pin", "keep"):
            return _bool(v, name)
        return None if v is None else str(v)
    except (TypeError, ValueError):
        raise HintError(f"hint {name}: {v!r} is not valid") from None


def parse_hints(body: Mapping[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
    """The request's hints as a dict with only the fields that were given."""
    out: dict[str, Any] = {}
    nvext = body.get("nvext")
    agent = nvext.get("agent_hints") if isinstance(nvext, dict) else None
    if isinstance(agent, dict):
        if "priority" in agent:
            out["priority"] = _coerce("priority", agent["priority"])
        if agent.get("prefix_id") is not None:
            out["session"] = str(agent["prefix_id"])
        for k in ("ttl_s", "pin", "session", "keep"):
            if k in agent:
                out[k] = _coerce(k, agent[k])
    own = body.get("pdsdk")
    if own is not None:
        if not isinstance(own, dict):
            raise HintError("the 'pdsdk' field must be an object like {\"session\": \"s1\", \"priority\": 1}")
        unknown = set(own) - set(FIELDS)
        if unknown:
            raise HintError(f"unknown pdsdk hint(s) {sorted(unknown)}; known: {', '.join(FIELDS)}")
        out.update({k: _coerce(k, v) for k, v in own.items()})
    for h, k in HEADERS.items():
        v = headers.get(h)
        if v is not None:
            out[k] = _coerce(k, v)
    return out
