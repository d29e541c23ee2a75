"""Reading a client request: JSON checks with clear reasons, and what routing needs from it."""

from __future__ import annotations

import json
import uuid
from typing import Any, Mapping

import msgspec

from pdsdk.router.hints import HintError, parse_hints
from pdsdk.router.policy import RouteRequest


class BadRequest(ValueError):
    """The client sent something we can say exactly what is wrong with (HTTP 400)."""


_json_decode = msgspec.json.decode


def parse_body(raw: bytes, kind: str) -> dict[str, Any]:
    """kind: "completions" or "chat"."""
    return read_body(raw, kind)[0]


def read_body(raw: bytes, kind: str) -> tuple[dict[str, Any], bool]:
    """(body, exact): exact when `raw` is plain UTF-8 JSON that the workers can be sent as it is."""
    try:
        return check_body(_json_decode(raw), kind), True  # the common case, fast
    except msgspec.DecodeError:
        pass
    try:  # what msgspec refuses (NaN, UTF-16, ...) json may still read; its errors say where
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadRequest(f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError:
        raise BadRequest("malformed JSON: body is not UTF-8") from None
    return check_body(body, kind), False


def check_body(body: Any, kind: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, not {type(body).__name__}")
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list")
    else:
        p = body.get("prompt")
        if p is None or (isinstance(p, (list, str)) and len(p) == 0):
            raise BadRequest("'prompt' is required and must not be empty")
        if not isinstance(p, (str, list)):
            raise BadRequest("'prompt' must be a string, a list of strings or a list of token ids")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be true or false")
    return body


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def route_request(body: dict[str, Any], headers: Mapping[str, str], kind: str) -> RouteRequest:
    """What policies see. Chat messages are flattened with their roles: a cheap stand-in for the
    chat template that keeps equal conversations equal and shared prefixes shared."""
    try:
        hints = parse_hints(body, headers)
    except HintError as e:
        raise BadRequest(str(e)) from None
    rid = headers.get("x-request-id") or uuid.uuid4().hex
    token_ids = None
    if kind == "chat":
        text = "".join(f"<|{m.get('role', '')}|>{_text_of(m.get('content'))}" for m in body["messages"]
                       if isinstance(m, dict))
    else:
        p = body["prompt"]
        if isinstance(p, list) and p and isinstance(p[0], (list, str)):
            p = p[0]  # a batch routes by its first prompt
        if isinstance(p, list):
            if not all(isinstance(t, int) for t in p):
                raise BadRequest("'prompt' token ids must be integers")
            token_ids, text = p, ""
        else:
            text = p
    return RouteRequest(request_id=rid, model=body.get("model"), text=text, token_ids=token_ids,
                        session=hints.get("session"), priority=hints.get("priority", 0),
                        extra={"hints": hints, "kind": kind, "stream": bool(body.get("stream"))})


def batch_size(body: dict[str, Any]) -> int:
    """Prompts in a completions batch (SGLang needs one bootstrap room per prompt)."""
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], (list, str)):
        return len(p)
    return 1
