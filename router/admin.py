"""Admin API: list, add, remove and drain workers; policy state. Guarded by the admin key
(separate from the client API key); with no admin key it answers only on a loopback bind."""

from __future__ import annotations

import asyncio
import hmac
import json

from aiohttp import web

from pdsdk.errors import ConfigError
from pdsdk.router.orchestrator import json_error
from pdsdk.router.workers import Worker

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def key_matches(request: web.Request, key: str) -> bool:
    auth = request.headers.get("Authorization", "")
    given = auth[7:] if auth.startswith("Bearer ") else request.headers.get("X-Api-Key", "")
    return hmac.compare_digest(given.encode(), key.encode())


def admin_denied(request: web.Request, router) -> web.Response | None:
    cfg = router.cfg
    if cfg.admin_key:
        return None if key_matches(request, cfg.admin_key) else json_error(401, "admin key required",
                                                                         "authentication_error")
    if cfg.host not in LOOPBACK:
        return json_error(403, "the admin API needs --admin-key when the router listens beyond loopback",
                          "permission_error")
    return None


async def _body(request: web.Request) -> dict:
    try:
        body = json.loads(await request.read() or b"{}")
    except json.JSONDecodeError as e:
        raise web.HTTPBadRequest(text=json.dumps({"error": {"message": f"malformed JSON: {e.msg}"}}),
                                 content_type="application/json") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text='{"error": {"message": "body must be a JSON object"}}',
                                 content_type="application/json")
    return body


def routes(router) -> list[web.RouteDef]:
    pool = router.pool

    def guarded(fn):
        async def handler(request: web.Request):
            return admin_denied(request, router) or await fn(request)
        return handler

    async def list_workers(request):
        return web.json_response({"workers": [w.describe() for w in pool.workers.values()]})

    async def add_worker(request):
        b = await _body(request)
        if "url" not in b:
            return json_error(400, "'url' is required")
        default_role = "plain" if not router.cfg.pd else None
        try:
            w = Worker(b["url"], role=b.get("role") or default_role or "", source="admin",
                       bootstrap_port=b.get("bootstrap_port"), kv_events=b.get("kv_events"),
                       kv_replay=b.get("kv_replay"))
        except ConfigError as e:
            return json_error(400, str(e))
        if (w.role == "plain") == router.cfg.pd:
            return json_error(400, f"role {w.role!r} does not fit a router in {'PD' if router.cfg.pd else 'plain'} "
                                   "mode (use prefill/decode in PD mode, plain otherwise)")
        w = router.add_worker(w)
        return web.json_response(w.describe(), status=201)

    async def remove_worker(request):
        url = request.query.get("url") or (await _body(request)).get("url")
        w = pool.remove(url or "")
        return web.json_response(w.describe()) if w else json_error(404, f"no worker {url!r}")

    async def drain_worker(request):
        b = await _body(request)
        w = pool.get(b.get("url", ""))
        if w is None:
            return json_error(404, f"no worker {b.get('url')!r}")
        w.draining = True
        if b.get("remove", True):
            router.spawn(_remove_when_idle(pool, w))
        return web.json_response(w.describe())

    async def policies(request):
        return web.json_response({role: {"policy": p.name, **p.stats()} for role, p in router.policies.items()},
                                 dumps=lambda o: json.dumps(o, default=str))

    return [web.get("/admin/workers", guarded(list_workers)),
            web.post("/admin/workers", guarded(add_worker)),
            web.delete("/admin/workers", guarded(remove_worker)),
            web.post("/admin/workers/drain", guarded(drain_worker)),
            web.get("/admin/policies", guarded(policies))]


async def _remove_when_idle(pool, w: Worker, poll_s: float = 0.05) -> None:
    while w.inflight > 0 and w.draining and pool.get(w.url) is w:
        await asyncio.sleep(poll_s)
    if w.draining and pool.get(w.url) is w:
        pool.remove(w.url)
