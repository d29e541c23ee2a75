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


PRIORITY_MIN, PRIORITY_MAX = -(1 << 31), (1 << 31) - 1
MAX_TEXT = 256  # characters of a session id: each is kept by the session policy


def _bool(v: Any, name: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("1", "true", "yes", "0", "false", "no"):
        return v.lower() in ("1", "true", "yes")
    if isinstance(v, int):
        return bool(v)
    raise HintError(f"hint {name} must be a boolean, got {_show(v)}")


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _priority(v: Any) -> int:
    if isinstance(v, float) and v.is_integer():  # false for NaN and the infinities
        v = int(v)
    elif isinstance(v, str):
        try:
            v = int(v.strip())
        except ValueError:
            v = None
    if not isinstance(v, int) or isinstance(v, bool) or not PRIORITY_MIN <= v <= PRIORITY_MAX:
        raise HintError(f"hint priority must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX}")
    return v


def _ttl(v: Any) -> float | None:
    if v is None:
        return None
    try:
        t = float(v) if isinstance(v, (int, float, str)) and not isinstance(v, bool) else None
    except (ValueError, OverflowError):
        t = None
    if t is None or not 0 <= t < float("inf"):
        raise HintError(f"hint ttl_s must be a finite number of seconds >= 0, got {_show(v)}")
    return t


def _text(name: str, v: Any) -> str | None:
    if v is None:
        return None
    s = v if isinstance(v, str) else str(v) if isinstance(v, (int, float)) else None
    if s is None or not 0 < len(s) <= MAX_TEXT or any(ord(c) < 32 or 0xD800 <= ord(c) <= 0xDFFF for c in s):
        raise HintError(f"hint {name} must be text of 1 to {MAX_TEXT} characters without control characters, "
                        f"got {_show(v)}")
    return s


def _coerce(name: str, v: Any) -> Any:
    if name == "priority":
        return _priority(v)
    if name == "ttl_s":
        return _ttl(v)
    if name in ("pin", "keep"):
        return _bool(v, name)
    return _text(name, v)


def parse_hints(body: Mapping[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
    """The request's hints as a dict with only the fields that were given."""
    out: dict[str, Any] = {}
    nvext = body.get("nvext")
    agent = nvext.get("agent_hints") if isinstance(nvext, dict) else None
    if isinstance(agent, dict):
        if "priority" in agent:
            out["priority"] = _coerce("priority", agent["priority"])
        if agent.get("prefix_id") is not None:
            out["session"] = _text("session (nvext.agent_hints.prefix_id)", agent["prefix_id"])
        for k in ("ttl_s", "pin", "session", "keep"):
            if k in agent:
                out[k] = _coerce(k, agent[k])
    own = body.get("pdsdk")
    if own is not None:
        if not isinstance(own, dict):
            raise HintError("the 'pdsdk' field must be an object like {\"session\": \"s1\", \"priority\": 1}")
        unknown = set(own) - set(FIELDS)
        if unknown:
            raise HintError(f"unknown pdsdk hint(s) {_show(sorted(unknown))}; known: {', '.join(FIELDS)}")
        out.update({k: _coerce(k, v) for k, v in own.items()})
    for h, k in HEADERS.items():
        v = headers.get(h)
        if v is not None:
            out[k] = _coerce(k, v)
    return out
