"""The router's HTTP server: OpenAI-compatible client routes, /health, /metrics, admin API."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import signal
import socket
import time

import aiohttp
from aiohttp import web

from pdsdk.errors import ConfigError
from pdsdk.router import admin, metrics
from pdsdk.router.config import RouterConfig
from pdsdk.router.http.bodies import BodyError, answer_and_close, expect_handler, receive_body
from pdsdk.router.http.client_log import ServerLog, ThrottledLog
from pdsdk.router.http.client_request import BadRequest, read_body, route_request
from pdsdk.router.http.gate import Gate, GateSite, fit_to_fd_limit
from pdsdk.router.http.worker_client import H1Pool
from pdsdk.router.orchestrator import Orchestrator, json_error
from pdsdk.router.policies.base import Policy, build_policy
from pdsdk.router.worker_set import WorkerSet
from pdsdk.router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)
ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class Router:
    """One serving process. It owns its worker set (`workers`), or, as one of `--processes N`,
    mirrors the primary's through `link` (processes/link.py)."""

    def __init__(self, cfg: RouterConfig, link=None):
        cfg.validate()
        self.cfg = cfg
        self.pool = WorkerPool()
        roles = ("prefill", "decode") if cfg.pd else ("plain",)
        self.policies: dict[str, Policy] = {
            r: build_policy(cfg.policy_for(r), cfg.policy_options.get(cfg.policy_for(r))) for r in roles}
        self.pool.listeners.append(self._on_pool_change)
        self.link = link
        self.workers = WorkerSet(cfg, self.pool) if link is None else None
        self.admin_ops = self.workers or link  # where the admin API's changes go
        self.session: aiohttp.ClientSession | None = None
        self.client: H1Pool | None = None
        self.orchestrator: Orchestrator | None = None
        self.clients = ThrottledLog()  # bad requests: one log line per client per minute
        self.gate = Gate(cfg.max_connections, cfg.max_client_connections, cfg.read_timeout_s, self.clients)
        if cfg.pd and cfg.engine == "sglang" and cfg.disagg_threshold > 0:
            log.warning("--disagg-threshold is ignored with SGLang: its decode servers cannot prefill alone")

    def add_worker(self, w: Worker) -> Worker:
        return self.workers.add_worker(w)

    def _on_pool_change(self, event: str, w: Worker) -> None:
        policy = self.policies.get(w.role)
        if policy is not None:
            (policy.add_worker if event == "add" else policy.remove_worker)(w)

    # --- app ------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self.gate.middleware])
        routes = [("POST", "/v1/completions", self.handle_generate), ("POST", "/v1/chat/completions",
                  self.handle_generate), ("GET", "/v1/models", self.handle_models),
                  ("GET", "/health", self.handle_health), ("GET", "/live", self.handle_live),
                  ("GET", "/metrics", self.handle_metrics), *admin.routes(self)]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler, expect_handler=expect_handler)
        # every other path or method: our answer, through our Expect handler (not aiohttp's, see there)
        known = {path for _, path, _ in routes}
        app.router.add_route("*", "/{path:.*}", functools.partial(_no_route, known=known),
                             expect_handler=expect_handler)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s))
        # the request hot path talks to workers with the lean client; health checks use aiohttp
        self.client = H1Pool(connect_timeout=self.cfg.connect_timeout_s)
        self.orchestrator = Orchestrator(self.cfg, self.pool, self.policies, self.client)
        if self.link is None:
            await self.workers.start(self.session)
        else:
            await self.link.start(self)

    async def _cleanup(self, app) -> None:
        await (self.workers or self.link).stop()
        for p in self.policies.values():
            p.close()
        if self.session is not None:
            await self.session.close()
        if self.client is not None:
            await self.client.close()

    # --- handlers -------------------------------------------------------------------------
    def _client_denied(self, request: web.Request) -> web.Response | None:
        if self.cfg.api_key and not admin.key_matches(request, self.cfg.api_key):
            return json_error(401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error")
        return None

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        start = time.perf_counter()
        route = ROUTES[request.path]
        denied = self._client_denied(request)
        if denied:
            metrics.count_request(route, "401")
            return denied
        try:
            raw = await receive_body(request, self.cfg.max_body_bytes, self.cfg.read_timeout_s)
        except BodyError as e:
            metrics.count_request(route, str(e.status))
            resp = json_error(e.status, str(e))
            return await answer_and_close(request, resp) if e.status == 408 else resp
        try:
            body, exact = read_body(raw, route)
            req = route_request(body, request.headers, route)
        except BadRequest as e:
            metrics.count_request(route, "400")
            return json_error(400, str(e))
        req.extra["t0"] = start
        if exact:
            req.extra["raw"] = raw  # sent on as it is when the worker's body is the client's
        if req.model is not None and not self._serves(req.model):
            known = self.cfg.models or self.pool.models()
            metrics.count_request(route, "404")
            return json_error(404, f"model {req.model!r} is not served here; served: {', '.join(known)}",
                              "not_found_error")
        resp = await self.orchestrator.serve(request, body, req, request.path)
        metrics.count_request(route, str(resp.status))
        metrics.DURATION.observe(time.perf_counter() - start)
        return resp

    def _serves(self, model: str) -> bool:
        """--model names when given, else what the workers said (a worker set that said nothing serves any)."""
        return model in self.cfg.models if self.cfg.models else self.pool.serves(model)

    async def handle_models(self, request: web.Request) -> web.Response:
        denied = self._client_denied(request)
        if denied:
            return denied
        names = self.cfg.models or self.pool.models()
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "pdsdk"} for m in names]})

    async def handle_health(self, request: web.Request) -> web.Response:
        roles = ("prefill", "decode") if self.cfg.pd else ("plain",)
        usable = {r: len(self.pool.candidates(r)) for r in roles}
        ok = all(usable.values()) or (self.cfg.pd and usable.get("decode") and self.cfg.disagg_threshold > 0
                                      and self.cfg.engine == "vllm")
        return web.json_response({"status": "ok" if ok else "unavailable", "usable_workers": usable},
                                 status=200 if ok else 503)

    async def handle_live(self, request: web.Request) -> web.Response:
        """Liveness: the router answers (readiness, with usable workers, is /health)."""
        return web.Response(text="ok")

    async def handle_metrics(self, request: web.Request) -> web.Response:
        body, content_type = metrics.scrape(self, shared=self.link is not None)
        return web.Response(body=body, content_type=content_type)


async def _no_route(request: web.Request, known: set[str]) -> web.Response:
    if request.path in known:
        return json_error(405, f"{request.method[:20]} is not allowed on {request.path}")
    return json_error(404, f"no such path {request.path[:100]!r}", "not_found_error")


SHUTDOWN_GRACE_S = 5.0
GC_YOUNG_THRESHOLD = 20_000
KEEPALIVE_S, LINGER_S = 75.0, 2.0


async def start(cfg: RouterConfig, link=None) -> tuple[Router, web.AppRunner, int]:
    """Start a router on cfg.host:cfg.port (port 0: any free port); returns the bound port. With a
    `link` it is one of several processes on that port (SO_REUSEPORT), or on the inherited socket."""
    router = Router(cfg, link)
    # Stopping waits at most SHUTDOWN_GRACE_S for requests in flight (aiohttp's default is 60 s: a
    # stop signal must not look like a hang; the launcher escalates to SIGKILL after 20 s anyway).
    # Idle keep-alive connections close after KEEPALIVE_S; an answer refused before its body was read
    # (413) lingers LINGER_S to let the client read it, not aiohttp's 10 s of reading and discarding.
    # Bodies come as sent: a compressed one is refused (http/bodies.py), never inflated.
    runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_GRACE_S, keepalive_timeout=KEEPALIVE_S,
                           lingering_time=LINGER_S, logger=ServerLog(router.clients),
                           auto_decompress=False)
    await runner.setup()
    router.gate.max_connections = fit_to_fd_limit(cfg.max_connections)
    try:
        sock = _inherited(cfg.listen_fd) if cfg.listen_fd is not None else None
        site = GateSite(runner, cfg.host, cfg.port, router.gate, backlog=2048, sock=sock,
                        reuse_port=link is not None and sock is None)
        await site.start()
    except ConfigError:
        await runner.cleanup()
        raise
    except OSError as e:
        await runner.cleanup()
        raise ConfigError("--port", f"cannot listen on {cfg.host}:{cfg.port} ({e.strerror or e}); pick another "
                                    "--port or stop what listens there") from None
    port = runner.addresses[0][1]
    return router, runner, port


def _inherited(fd: int) -> socket.socket:
    """The listening socket a launcher passed down: connections wait in its backlog while a router restarts."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise ConfigError("--listen-fd", f"{fd} is not an open socket ({e.strerror or e})") from None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.detach()
        raise ConfigError("--listen-fd", f"{fd} is not a TCP socket")
    return sock


def run(cfg: RouterConfig, link=None) -> None:
    """Serve until SIGINT or SIGTERM: the whole router, or (with `link`) one of its processes."""
    async def main() -> None:
        router, runner, port = await start(cfg, link)
        # Start-up objects (imports, parsers, the app) move out of the collector's reach: its full
        # passes then walk only what requests hold, and stop the event loop that much shorter.
        gc.collect()
        gc.freeze()
        # A request's objects die with it, by refcounting. Collecting the young generation every 700
        # net allocations still caught them in flight (about 10 us of CPU per request at 50 streams);
        # at 20,000 the collector runs when garbage really piles up.
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        if link is None:
            print(f"pdsdk router on http://{cfg.host}:{port} ({cfg.describe()})", flush=True)
        else:
            await link.ready()
        stop = asyncio.Event()
        # Handled explicitly: a process started in the background inherits SIGINT as ignored, and
        # SIGTERM's default would skip the cleanup (workers' connections, kv-event streams).
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    try:
        import uvloop  # optional: when installed, the proxy path is markedly cheaper per request

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(main())
    except KeyboardInterrupt:
        pass
