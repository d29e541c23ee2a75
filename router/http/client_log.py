"""Log lines that clients can cause at will (bad requests, and the failed attempts their bodies
make): one per source per minute, never a traceback for what a client sent, so that no client can
flood the log."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import OrderedDict

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

log = logging.getLogger("pdsdk.router")


class ThrottledLog:
    """At most one log line per source (a client address, a worker) and kind per period, saying how
    many were held back."""

    def __init__(self, period_s: float = 60.0, max_sources: int = 4096):
        self.period_s, self.max_sources = period_s, max_sources
        self._seen: OrderedDict[tuple[str, str], list] = OrderedDict()  # key -> [last line at, held back]

    def allow(self, source: str, kind: str = "bad request") -> int | None:
        """None: stay quiet; else log now, and this many lines were held back since the last."""
        key, now = (source, kind), time.monotonic()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.period_s:
            seen[1] += 1
            return None
        held = seen[1] if seen is not None else 0
        self._seen[key] = [now, 0]
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_sources:
            self._seen.popitem(last=False)
        return held

    def note(self, client: str, message) -> None:
        """Log `message` (a string, or a function that makes it) unless this client was heard lately."""
        held = self.allow(client)
        if held is not None:
            text = message() if callable(message) else message
            log.warning("client %s: %s%s", client, text, self.more(held))

    def more(self, held: int) -> str:
        return f" ({held} more in the last {self.period_s:g} s)" if held else ""


class ServerLog(logging.LoggerAdapter):
    """aiohttp's server logger. A malformed HTTP request is the client's fault: one line, no
    traceback. Anything else is ours and keeps its traceback; both are rate-limited per client."""

    def __init__(self, clients: ThrottledLog):
        super().__init__(logging.getLogger("pdsdk.router.http"), {})
        self.clients = clients

    def log(self, level, msg, *args, exc_info=None, **kwargs):
        exc = exc_info if isinstance(exc_info, BaseException) else \
            exc_info[1] if isinstance(exc_info, tuple) else sys.exc_info()[1] if exc_info else None
        client = str(args[0]) if args and isinstance(msg, str) and msg.endswith("from %s") else "-"
        if isinstance(exc, HttpProcessingError):
            return self.clients.note(client, f"malformed HTTP request: {exc.message or type(exc).__name__}")
        if level < logging.WARNING or self.clients.allow(client, "server error") is not None:
            super().log(level, msg, *args, exc_info=exc_info, **kwargs)


def error_message(resp: web.StreamResponse) -> str:
    try:
        return str(json.loads(resp.body)["error"]["message"])[:300]
    except (TypeError, ValueError, KeyError, AttributeError):
        return resp.reason or ""
