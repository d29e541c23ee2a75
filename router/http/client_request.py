"""Reading a client request: JSON checks with clear reasons, and what routing needs from it."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from typing import Any, Mapping

import msgspec

from pdsdk.router.http.hints import HintError, parse_hints
from pdsdk.router.policies.base import RouteRequest


class BadRequest(ValueError):
    """The client sent something we can say exactly what is wrong with (HTTP 400)."""


_json_decode = msgspec.json.decode
MIN_TIMEOUT_S = 1.0  # floor of a client's X-Request-Timeout: a shorter deadline only wastes a worker's start
MAX_REQUEST_ID = 256
MAX_DEPTH = 128  # JSON nesting: far beyond any OpenAI body, far below the interpreter's recursion limit
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[][{}]")


def parse_body(raw: bytes, kind: str) -> dict[str, Any]:
    """kind: "completions" or "chat"."""
    return read_body(raw, kind)[0]


def read_body(raw: bytes, kind: str) -> tuple[dict[str, Any], bool]:
    """(body, exact): exact when `raw` is plain UTF-8 JSON that the workers can be sent as it is."""
    try:
        body, exact = _json_decode(raw), True  # the common case, fast
    except msgspec.DecodeError:
        body = exact = None
    except RecursionError:
        raise BadRequest(f"malformed JSON: nested deeper than {MAX_DEPTH} levels") from None
    if exact is None:
        try:  # what msgspec refuses (NaN, UTF-16, ...) json may still read; its errors say where
            body = json.loads(raw)
            raw = msgspec.json.encode(body)  # it is re-encoded for the workers: that must work
        except json.JSONDecodeError as e:
            raise BadRequest(f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        except UnicodeDecodeError:
            raise BadRequest("malformed JSON: body is not UTF-8") from None
        except UnicodeEncodeError:
            raise BadRequest("malformed JSON: a \\u escape leaves a lone UTF-16 surrogate (\\ud800-\\udfff), "
                             "which is not Unicode text") from None
        except RecursionError:
            raise BadRequest(f"malformed JSON: nested deeper than {MAX_DEPTH} levels") from None
        exact = False
    if _too_deep(raw):
        raise BadRequest(f"malformed JSON: nested deeper than {MAX_DEPTH} levels")
    return check_body(body, kind), exact


def _too_deep(raw: bytes) -> bool:
    """Nested deeper than MAX_DEPTH? Counted only when there are brackets enough for that."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    depth = 0
    for b in _BRACKET.findall(_STRING.sub(b"", raw)):
        depth += 1 if b in b"[{" else -1
        if depth > MAX_DEPTH:
            return True
    return False


def check_body(body: Any, kind: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, not {type(body).__name__}")
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list")
        for i, m in enumerate(msgs):
            _check_message(m, f"messages[{i}]")
    else:
        p = body.get("prompt")
        if p is None or (isinstance(p, (list, str)) and len(p) == 0):
            raise BadRequest("'prompt' is required and must not be empty")
        if not isinstance(p, (str, list)):
            raise BadRequest("'prompt' must be a string, a list of strings or a list of token ids")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be true or false")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise BadRequest("'model' must be a string")
    return body


def _check_message(m: Any, where: str) -> None:
    """What routing reads of a chat message: its role, and its content as text or content parts."""
    if not isinstance(m, dict):
        raise BadRequest(f"'{where}' must be an object like {{\"role\": \"user\", \"content\": \"...\"}}")
    if not isinstance(m.get("role", ""), str):
        raise BadRequest(f"'{where}.role' must be a string")
    content = m.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise BadRequest(f"'{where}.content[{j}]' must be an object like "
                                 '{"type": "text", "text": "..."}')
            if not isinstance(part.get("text", ""), str):
                raise BadRequest(f"'{where}.content[{j}].text' must be a string")
    elif content is not None and not isinstance(content, str):
        raise BadRequest(f"'{where}.content' must be a string, a list of content parts or null")


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in content)
    return ""


class _Ids:
    """New request ids: 32 hex digits like a uuid4's, 16 random ones per process and a count (a
    uuid4 per request reads the system's randomness each time)."""

    prefix = os.urandom(8).hex()
    count = itertools.count()

    @classmethod
    def renew(cls) -> None:
        cls.prefix, cls.count = os.urandom(8).hex(), itertools.count()


os.register_at_fork(after_in_child=_Ids.renew)


def new_request_id() -> str:
    return f"{_Ids.prefix}{next(_Ids.count):016x}"


def request_id(headers: Mapping[str, str]) -> str:
    """The client's X-Request-Id (it goes on to the workers as a header), or a new one."""
    rid = headers.get("x-request-id")
    if not rid:
        return new_request_id()
    if len(rid) > MAX_REQUEST_ID or not all("!" <= c <= "~" for c in rid):
        raise BadRequest(f"X-Request-Id must be 1 to {MAX_REQUEST_ID} visible ASCII characters")
    return rid


def client_timeout(headers: Mapping[str, str]) -> float | None:
    """The client's X-Request-Timeout in seconds (at least MIN_TIMEOUT_S), or None."""
    asked = headers.get("x-request-timeout")
    if asked is None:
        return None
    try:
        t = float(asked)
    except ValueError:
        t = math.nan
    if not 0 <= t < math.inf:
        raise BadRequest(f"X-Request-Timeout must be a finite number of seconds >= 0, got {asked[:40]!r}")
    return max(t, MIN_TIMEOUT_S)


def route_request(body: dict[str, Any], headers: Mapping[str, str], kind: str) -> RouteRequest:
    """What policies see. Chat messages are flattened with their roles: a cheap stand-in for the
    chat template that keeps equal conversations equal and shared prefixes shared."""
    try:
        hints = parse_hints(body, headers)
    except HintError as e:
        raise BadRequest(str(e)) from None
    rid = request_id(headers)
    timeout = client_timeout(headers)
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
                        extra={"hints": hints, "kind": kind, "stream": bool(body.get("stream")),
                               "timeout": timeout})


def batch_size(body: dict[str, Any]) -> int:
    """Prompts in a completions batch (SGLang needs one bootstrap room per prompt)."""
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], (list, str)):
        return len(p)
    return 1
