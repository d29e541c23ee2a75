"""One client request end to end: pick workers, run the engine's PD protocol, retry on a new
worker or pair while nothing has reached the client, account load and breakers, and cancel the
workers' requests when the client goes away (closing a connection makes vLLM/SGLang abort)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from aiohttp import web

from pdsdk import plugins
from pdsdk.router import metrics, pd_bodies
from pdsdk.router.config import RouterConfig
from pdsdk.router.http.client_log import ThrottledLog
from pdsdk.router.http.client_request import batch_size, new_request_id
from pdsdk.router.http.upstream import Retryable, open_stream, passthrough, post_json, read_all, relay
from pdsdk.router.http.worker_client import H1Pool
from pdsdk.router.policies.base import Choice, NoWorker, Policy, RouteRequest
from pdsdk.router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)
DEADLINE_SLACK_S = 1e-3  # a timer may fire a hair before the deadline it was set for


@dataclass
class Plan:
    main: Worker  # plain worker, or the decode worker in PD mode
    prefill: Worker | None = None  # None in PD mode: decode alone (conditional disaggregation)


def json_error(status: int, message: str, kind: str = "invalid_request_error", **headers: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status, headers=headers)


class Orchestrator:
    def __init__(self, cfg: RouterConfig, pool: WorkerPool, policies: dict[str, Policy], client: H1Pool):
        self.cfg, self.pool, self.policies, self.client = cfg, pool, policies, client
        self._warned_no_params: set[str] = set()
        self._ask_tokens = cfg.tokenize_via_worker  # off for good when a worker has no /tokenize (auto)
        self.failures = ThrottledLog()  # one line per worker per minute about failed attempts
        # Made in the serving loop. Kept: asyncio.get_running_loop() is a getpid() system call on Python 3.11.
        self.loop = asyncio.get_running_loop()

    # --- planning -------------------------------------------------------------------------
    def _choose(self, role: str, req: RouteRequest, excluded: set[str]) -> Choice:
        cands = self.pool.candidates(role, excluded, req.model)
        policy = self.policies[role]
        choice = policy.choose(cands, req)
        plugins.notify("pdsdk_route_decision", policy=policy.name, request_id=req.request_id, role=role,
                       worker=choice.worker.url, reason=choice.reason)
        return choice

    def plan(self, req: RouteRequest, excluded: set[str]) -> Plan:
        if not self.cfg.pd:
            return Plan(self._choose("plain", req, excluded).worker)
        d = self._choose("decode", req, excluded)
        # Conditional disaggregation (vLLM only: an SGLang decode server cannot prefill alone)
        alone = self.cfg.engine == "vllm"
        if alone and self.cfg.disagg_threshold > 0 and req.prompt_tokens - d.cached_tokens < self.cfg.disagg_threshold:
            metrics.LOCAL_PREFILL.labels("short_prompt").inc()
            return Plan(d.worker)
        try:
            return Plan(d.worker, self._choose("prefill", req, excluded).worker)
        except NoWorker:
            if not alone:
                raise
            # Every prefill is down, draining or failed this request: a vLLM decode worker prefills
            # itself (slower, but the request is served, not refused)
            metrics.LOCAL_PREFILL.labels("no_prefill").inc()
            return Plan(d.worker)

    # --- the request ----------------------------------------------------------------------
    async def serve(self, request: web.Request, body: dict, req: RouteRequest, path: str) -> web.StreamResponse:
        loop = self.loop
        budget, asked = self.cfg.request_timeout_s, req.extra.get("timeout")
        if asked is not None and asked < budget:
            budget = asked
            req.extra["clients_deadline"] = True  # its timeouts are not the workers' fault
        deadline = loop.time() + budget
        if self._ask_tokens and req.token_ids is None and \
                any(p.needs_tokens for p in self.policies.values()):
            await self._tokenize(body, req)
        excluded: set[str] = set()
        last: Retryable | None = None
        refused: list[Worker] = []  # answered an error status: blamed only once another worker serves it
        for attempt in range(self.cfg.retries + 1):
            try:
                plan = self.plan(req, excluded)
            except NoWorker:
                break
            try:
                resp = await self._attempt(request, body, req, path, plan, deadline)
            except Retryable as e:
                last = e
                excluded.update(w.url for w in e.suspects)
                if e.status is not None:
                    refused.append(e.worker)
                metrics.RETRIES.labels(e.worker.role).inc()
                held = self.failures.allow(e.worker.url, "attempt failed")  # clients can make these at will
                if held is not None:
                    log.warning("request %s attempt %d failed: %s%s", req.request_id, attempt + 1, e,
                                self.failures.more(held))
            else:
                if resp.status < 400:  # the request was servable: those error answers were the workers'
                    for w in refused:
                        w.breaker.record(False)
                return resp
            if loop.time() >= deadline - DEADLINE_SLACK_S:
                return json_error(504, f"request deadline passed; last error: {last}", "timeout")
        if last is not None:
            return json_error(502, f"no worker could serve the request: {last}", "upstream_error")
        return json_error(503, "no healthy worker for this request; retry later", "unavailable",
                          **{"Retry-After": str(self.cfg.retry_after_s)})

    async def _attempt(self, request, body, req, path, plan: Plan, deadline: float) -> web.StreamResponse:
        workers = [w for w in (plan.prefill, plan.main) if w is not None]
        judged: set[str] = set()
        for w in workers:
            w.begin()
            w.breaker.started()
            self.policies[w.role].on_start(w, req)
        ok = False
        try:
            if not self.cfg.pd:
                raw = req.extra.get("raw")
                out = raw if raw is not None and _unchanged(self.cfg.engine, body, req) else \
                    pd_body(self.cfg.engine, body, req)
                resp = await self._single(request, plan.main, path, out, req, deadline, judged)
            elif self.cfg.engine == "vllm":
                resp = await self._vllm(request, plan, path, body, req, deadline, judged)
            else:
                resp = await self._sglang(request, plan, path, body, req, deadline, judged)
            ok = True
            return resp
        except Retryable as e:
            e.worker.last_error = e.reason
            if self._workers_fault(e, req, deadline):
                e.worker.breaker.record(False)
                judged.add(e.worker.url)
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            metrics.CLIENT_CANCELLED.inc()
            raise
        finally:
            for w in workers:
                w.end()
                if w.url not in judged:
                    w.breaker.release()
                self.policies[w.role].on_finish(w, req, ok)

    def _workers_fault(self, e: Retryable, req: RouteRequest, deadline: float) -> bool:
        """Does this failure count against the worker's breaker at once? Not when the client's own
        deadline ran out, and not yet for an error status: a body no worker can serve is the client's."""
        if e.status is not None:
            return False
        return not (e.timed_out and req.extra.get("clients_deadline")
                    and self.loop.time() >= deadline - DEADLINE_SLACK_S)

    def _headers(self, rid: str) -> dict[str, str]:
        h = {"X-Request-Id": rid}
        if self.cfg.worker_api_key:
            h["Authorization"] = f"Bearer {self.cfg.worker_api_key}"
        return h

    def _first_timeout(self, stream: bool, deadline: float) -> float:
        left = max(0.0, deadline - self.loop.time())
        # A non-streamed answer only starts when generation ends: only the deadline bounds it.
        return min(self.cfg.first_token_timeout_s, left) if stream else left

    async def _single(self, request, w: Worker, path: str, body: dict, req: RouteRequest, deadline: float,
                      judged: set[str], rid: str | None = None, watch: asyncio.Task | None = None):
        """Send to one worker and answer the client from it (plain, decode, decode-alone)."""
        rid = rid or req.request_id
        stream = req.extra["stream"] if isinstance(body, bytes) else bool(body.get("stream"))
        first_timeout = self._first_timeout(stream, deadline)
        if watch is None:
            opened = await open_stream(self.client, w, path, body, self._headers(rid), first_timeout)
        else:  # SGLang: a failing prefill fails the pair before decode's first token
            opening = asyncio.ensure_future(open_stream(self.client, w, path, body, self._headers(rid),
                                                        first_timeout))
            try:
                await asyncio.wait({opening, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not opening.done() and watch.done() and watch.exception() is not None:
                    opening.cancel()
                    raise watch.exception()
                opened = await opening
            finally:
                if not opening.done():
                    opening.cancel()
        w.breaker.record(True)
        judged.add(w.url)
        if "t0" in req.extra:
            metrics.TTFB.observe(time.perf_counter() - req.extra["t0"])
        if opened.resp.status >= 400 or not stream:
            left = max(0.0, deadline - self.loop.time())
            data = await read_all(opened, left)
            return passthrough(opened.resp.status, data, opened.resp.content_type, req.request_id)
        return await relay(request, opened, self.cfg.first_token_timeout_s, deadline, req.request_id, self.loop)

    async def _vllm(self, request, plan: Plan, path, body, req: RouteRequest, deadline, judged):
        hints = req.extra.get("hints", {})
        if plan.prefill is None:
            return await self._single(request, plan.main, path, pd_bodies.vllm_plain_body(body, hints), req, deadline,
                                      judged)
        p = plan.prefill
        rid = f"{req.request_id}-{new_request_id()[-8:]}"  # one id per attempt, same on both sides
        status, data = await post_json(self.client, p, path, pd_bodies.vllm_prefill_body(body, hints),
                                       self._headers(rid), self._first_timeout(True, deadline))
        p.breaker.record(True)
        judged.add(p.url)
        if status >= 400:  # the client's fault (RETRY_STATUSES were raised as Retryable)
            return passthrough(status, data, "application/json", req.request_id)
        try:
            params = _json(data).get("kv_transfer_params")
        except ValueError:
            raise Retryable(p, "prefill answered with invalid JSON") from None
        if not params:
            metrics.MISSING_PARAMS.labels(p.url).inc()
            if p.url not in self._warned_no_params:
                self._warned_no_params.add(p.url)
                log.warning("prefill worker %s returned no kv_transfer_params: is it started with a KV "
                            "connector (--kv-transfer-config)? Decode will recompute the prompt.", p.url)
        return await self._single(request, plan.main, path, pd_bodies.vllm_decode_body(body, params, hints), req,
                                  deadline, judged, rid=rid)

    async def _sglang(self, request, plan: Plan, path, body, req: RouteRequest, deadline, judged):
        hints = req.extra.get("hints", {})
        p = plan.prefill
        if p is None:
            return await self._single(request, plan.main, path, pd_bodies.sglang_plain_body(body, hints), req,
                                      deadline, judged)
        n = batch_size(body)
        pbody = pd_bodies.sglang_pd_body(body, p.host, p.bootstrap_port, pd_bodies.new_room(n), n, hints)
        left = max(0.0, deadline - self.loop.time())
        prefill = asyncio.ensure_future(post_json(self.client, p, path, pbody, self._headers(req.request_id),
                                                  left))
        try:
            try:
                resp = await self._single(request, plan.main, path, pbody, req, deadline, judged, watch=prefill)
            except Retryable as e:
                if e.worker is plan.main and not prefill.done():
                    e.suspects.append(p)  # decode waits on prefill's KV: the silent one may be either
                raise
            if prefill.done() and prefill.exception() is None:
                p.breaker.record(prefill.result()[0] < 500)
                judged.add(p.url)
            return resp
        finally:
            if not prefill.done():  # decode finished or failed, or the client left: stop prefill too
                prefill.cancel()
            await asyncio.gather(prefill, return_exceptions=True)

    async def _tokenize(self, body: dict, req: RouteRequest) -> None:
        """Token ids for kv_events routing, from a worker's POST /tokenize (the engine's own
        tokenizer and chat template). Best effort: on any failure the policy routes without them."""
        role = "decode" if self.cfg.pd else "plain"
        cands = self.pool.candidates(role, model=req.model)
        if not cands:
            return
        w = min(cands, key=lambda x: x.load)
        ask = tokenize_request(body, req.text)
        if ask is None:
            return
        try:
            status, data = await post_json(self.client, w, "/tokenize", ask, {}, 2.0)
            if status == 200:
                tokens = _json(data).get("tokens")
                if isinstance(tokens, list) and all(type(t) is int for t in tokens):
                    req.token_ids = tokens
            elif status in (404, 405) and self.cfg.tokenize == "auto":  # an engine version without it
                self._ask_tokens = False
                log.warning("%s has no POST /tokenize: kv_events routes text prompts without token ids from "
                            "now on (send token ids, or --tokenize none to skip asking)", w.url)
        except (Retryable, ValueError) as e:
            log.debug("tokenize via %s failed: %s", w.url, e)


def tokenize_request(body: dict, text: str | None) -> dict | None:
    """The body of POST /tokenize (vLLM's and SGLang's shape) for a client's request body: its chat
    messages, else its prompt text; None when it has neither."""
    if "messages" in body:
        return {"model": body.get("model"), "messages": body["messages"]}
    if text:
        return {"model": body.get("model"), "prompt": text}
    return None


def _json(data: bytes) -> dict:
    import json

    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


def _unchanged(engine: str, body: dict, req: RouteRequest) -> bool:
    """Would pd_body() send the client's body as it came? Then its bytes go out as they are."""
    if req.extra.get("hints"):
        return False
    return engine != "vllm" or ("pdsdk" not in body and "kv_transfer_params" not in body)


def pd_body(engine: str, body: dict, req: RouteRequest) -> dict:
    hints = req.extra.get("hints", {})
    return pd_bodies.vllm_plain_body(body, hints) if engine == "vllm" else pd_bodies.sglang_plain_body(body, hints)
