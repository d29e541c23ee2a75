"""Admin API: list, add, remove and drain workers; policy state. Guarded by the admin key
(separate from the client API key); with no admin key it answers only on a loopback bind, and only
to requests addressed to the router itself (Host and Origin), so no web page can reach it."""

from __future__ import annotations

import hmac
import ipaddress
import json
from urllib.parse import urlsplit

from aiohttp import web

from pdsdk.router.http.bodies import BodyError, answer_and_close, receive_body
from pdsdk.router.orchestrator import json_error
from pdsdk.router.worker_set import AdminError, admin_worker

LOOPBACK = ("127.0.0.1", "::1", "localhost")
MAX_BODY = 64 << 10


def key_matches(request: web.Request, key: str) -> bool:
    auth = request.headers.get("Authorization", "")
    given = auth[7:] if auth.startswith("Bearer ") else request.headers.get("X-Api-Key", "")
    # header bytes that are not UTF-8 come as surrogate escapes: compared as the bytes they were
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode())


def _is_own_host(host: str | None, bound: str) -> bool:
    """Is `host` (from a Host header or an Origin, port and brackets allowed) a name of this router:
    a loopback name or address, or the address it is bound to?"""
    if not host:
        return False
    try:
        name = urlsplit(f"//{host}").hostname or ""
    except ValueError:
        return False
    if name in ("localhost", bound.lower()) or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def cross_site(request: web.Request, bound: str) -> str | None:
    """Why a request is not addressed to this router (a web page's, or DNS rebinding), or None."""
    host = request.headers.get("Host")
    if host is not None and not _is_own_host(host, bound):
        return f"Host {host[:100]!r} is not this router's address"
    origin = request.headers.get("Origin")
    if origin is not None:
        parts = urlsplit(origin) if origin.isascii() else None
        if parts is None or parts.scheme not in ("http", "https") or not _is_own_host(parts.netloc, bound):
            return f"Origin {origin[:100]!r} is not this router"
    return None


def admin_denied(request: web.Request, router) -> web.Response | None:
    cfg = router.cfg
    if cfg.admin_key:
        if not key_matches(request, cfg.admin_key):
            return json_error(401, "admin key required", "authentication_error")
    elif cfg.host not in LOOPBACK:
        return json_error(403, "the admin API needs --admin-key when the router listens beyond loopback",
                          "permission_error")
    else:
        why = cross_site(request, cfg.host)
        if why:
            return json_error(403, f"cross-site admin request refused: {why} (loopback names or --host only; "
                                   "or set --admin-key)", "permission_error")
    if request.method == "POST" or request.body_exists:
        if request.content_type != "application/json":
            return json_error(415, f"admin requests with a body must be Content-Type: application/json, "
                                   f"not {request.content_type[:100]!r}")
    return None


async def _body(request: web.Request, idle_s: float) -> dict:
    if not request.body_exists:
        return {}
    raw = await receive_body(request, MAX_BODY, idle_s)
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, RecursionError) as e:
        raise AdminError(400, f"malformed JSON: {getattr(e, 'msg', 'nested too deep')}") from None
    if not isinstance(body, dict):
        raise AdminError(400, "body must be a JSON object")
    return body


def routes(router) -> list[tuple]:
    """(method, path, handler) of each admin route."""
    pool, idle_s = router.pool, router.cfg.read_timeout_s

    def guarded(fn):
        async def handler(request):
            denied = admin_denied(request, router)
            if denied:
                return denied
            try:
                return await fn(request)
            except AdminError as e:
                return json_error(e.status, str(e))
            except BodyError as e:
                resp = json_error(e.status, str(e))
                return await answer_and_close(request, resp) if e.status == 408 else resp
        return handler

    async def list_workers(request):
        return web.json_response({"workers": [w.describe() for w in pool.workers.values()]})

    async def add_worker(request):
        b = await _body(request, idle_s)
        w = admin_worker(router.cfg, _url(b.get("url")), b.get("role"), b.get("bootstrap_port"), b.get("kv_events"),
                         b.get("kv_replay"))
        return _answer(*await router.admin_ops.add(w))

    async def remove_worker(request):
        url = _url(request.query.get("url") or (await _body(request, idle_s)).get("url"))
        return _answer(*await router.admin_ops.remove(url))

    async def drain_worker(request):
        b = await _body(request, idle_s)
        url, remove = _url(b.get("url")), b.get("remove", True)
        if not isinstance(remove, bool):
            raise AdminError(400, "'remove' must be true or false")
        return _answer(*await router.admin_ops.drain(url, remove))

    async def policies(request):
        return web.json_response({role: {"policy": p.name, **p.stats()} for role, p in router.policies.items()},
                                 dumps=lambda o: json.dumps(o, default=str))

    return [("GET", "/admin/workers", guarded(list_workers)), ("POST", "/admin/workers", guarded(add_worker)),
            ("DELETE", "/admin/workers", guarded(remove_worker)),
            ("POST", "/admin/workers/drain", guarded(drain_worker)),
            ("GET", "/admin/policies", guarded(policies))]


def _url(value) -> str:
    if not isinstance(value, str) or not value:
        raise AdminError(400, "'url' is required and must be a string like http://10.0.0.5:8000")
    return value


def _answer(status: int, body: dict) -> web.Response:
    return web.json_response(body, status=status)
