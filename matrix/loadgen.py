"""The load generator behind `pdsdk bench serve`: streams OpenAI completions and times every chunk.

Arrivals follow a Poisson process at `rate` requests/s (inf: all at once), capped by `concurrency`
requests in flight; agent sessions arrive the same way and then run their turns in order. TTFT is
the time to the first chunk carrying a token (text, or token ids); ITL the gaps between later
chunks; E2E the whole request. Output tokens come from the final `usage` chunk
(`stream_options.include_usage`), else from the chunk count.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
import numpy as np

from pdsdk.errors import PdsdkError
from pdsdk.matrix.workload import AgentSession, Request, Workload, agent_sessions, random_requests


@dataclass
class LoadOptions:
    url: str  # the server's base URL, with or without /v1
    model: str | None = None  # default: the first of /v1/models
    rate: float = float("inf")
    concurrency: int = 0  # 0: unbounded
    warmup: int = 1
    timeout_s: float = 600.0
    ignore_eos: bool = True
    hints: bool = True  # send the agent's session id as the X-Pdsdk-Session header
    api_key: str | None = None
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request (e.g. return_token_ids)
    keep_output: bool = False  # keep each request's text and token ids (`pdsdk matrix` checks them)
    # Send again a request whose connection failed before any answer (the server never took it), after
    # 0.5 s, then 1 s, ...: what OpenAI's client does by default (max_retries 2).
    retries: int = 0


@dataclass
class Result:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    start_s: float = 0.0  # from the start of the run
    session: str | None = None
    turn: int = 0
    error: str = ""
    index: int = -1  # position in the workload (random dataset), to match outputs to their prompt
    text: str = ""  # with LoadOptions.keep_output
    token_ids: list[int] | None = None  # with keep_output and an engine that streams them (return_token_ids)
    retries: int = 0  # times it was sent again (LoadOptions.retries)


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def fetch_model(session: aiohttp.ClientSession, url: str) -> str:
    try:
        async with session.get(base_url(url) + "/models") as resp:
            if resp.status != 200:
                raise PdsdkError(f"{url}/v1/models answered {resp.status}: {(await resp.text())[:200]}")
            models = (await resp.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise PdsdkError(f"cannot reach {url} ({type(e).__name__}: {e}); is the server up?") from None
    if not models:
        raise PdsdkError(f"{url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def send(session: aiohttp.ClientSession, opts: LoadOptions, model: str, req: Request, t0: float) -> Result:
    body: dict[str, Any] = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if opts.ignore_eos:
        body.update(ignore_eos=True, min_tokens=req.max_tokens)
    body.update(opts.extra_body)
    headers = {"Content-Type": "application/json"}
    if opts.api_key:
        headers["Authorization"] = f"Bearer {opts.api_key}"
    if opts.hints and req.session:
        headers["X-Pdsdk-Session"] = req.session
    res = Result(False, len(req.prompt), session=req.session, turn=req.turn)
    start = time.perf_counter()
    res.start_s = start - t0
    last, chunks, usage = None, 0, None
    try:
        resp = await _post(session, base_url(opts.url) + "/completions", json.dumps(body), headers, opts.retries, res)
        async with resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if isinstance(msg.get("error"), dict):  # the server ended the stream with an error event
                    res.error = f"error event: {msg['error'].get('message')}"[:300]
                    continue
                if msg.get("usage"):
                    usage = msg["usage"]
                if opts.keep_output:
                    for c in msg.get("choices") or ():
                        res.text += c.get("text") or ""
                        if c.get("token_ids") is not None:
                            res.token_ids = (res.token_ids or []) + list(c["token_ids"])
                if not any(c.get("text") or c.get("token_ids") for c in msg.get("choices") or ()):  # a token (its text may be empty)
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft_s = now - start
                else:
                    res.itl_s.append(now - last)
                last, chunks = now, chunks + 1
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    res.e2e_s = time.perf_counter() - start
    res.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    res.prompt_tokens = int(usage["prompt_tokens"]) if usage else res.prompt_tokens
    res.ok = chunks > 0 and not res.error
    if not chunks and not res.error:
        res.error = "the stream ended without any text"
    return res


async def _post(session: aiohttp.ClientSession, url: str, body: str, headers: dict[str, str], retries: int,
                res: Result) -> aiohttp.ClientResponse:
    while True:
        try:
            return await session.post(url, data=body, headers=headers)
        except aiohttp.ClientConnectionError:  # no answer at all
            if res.retries >= retries:
                raise
            await asyncio.sleep(0.5 * 2 ** res.retries)
            res.retries += 1


class _Arrivals:
    """Poisson arrival times (seeded) and the in-flight cap."""

    def __init__(self, rate: float, concurrency: int, seed: int):
        self.rate, self.rng = rate, np.random.default_rng(seed)
        self.slots = asyncio.Semaphore(concurrency) if concurrency > 0 else None

    async def gap(self) -> None:
        if self.rate != float("inf"):
            await asyncio.sleep(self.rng.exponential(1.0 / self.rate))

    async def run(self, coro):
        if self.slots is None:
            return await coro
        async with self.slots:
            return await coro


async def run_load(opts: LoadOptions, workload: Workload, progress: Callable[[Result], None] | None = None,
                   ) -> tuple[list[Result], float, str]:
    """Send the workload; returns (results, wall seconds of the measured part, model)."""
    timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = opts.model or await fetch_model(session, opts.url)
        if opts.warmup:
            warm = Workload("random", num_prompts=opts.warmup, isl=min(workload.isl, 64), osl=4,
                            vocab=workload.vocab, seed=workload.seed + 7919)
            await asyncio.gather(*(send(session, opts, model, r, time.perf_counter()) for r in random_requests(warm)))
        arrivals = _Arrivals(opts.rate, opts.concurrency, opts.seed)
        results: list[Result] = []
        t0 = time.perf_counter()

        async def one(req: Request, index: int = -1) -> Result:
            res = await arrivals.run(send(session, opts, model, req, t0))
            res.index = index
            results.append(res)
            if progress:
                progress(res)
            return res

        async def agent(s: AgentSession) -> None:
            while (req := s.next_request()) is not None:
                if not (await one(req)).ok:
                    return  # a real agent would stop here too; the failure is counted
                s.answered()
                if s.turn < workload.agent.turns:
                    await asyncio.sleep(workload.agent.gap_s)

        tasks = []
        units = agent_sessions(workload) if workload.kind == "agent" else random_requests(workload)
        for i, unit in enumerate(units):
            tasks.append(asyncio.create_task(agent(unit) if workload.kind == "agent" else one(unit, i)))
            await arrivals.gap()
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0, model


def _dist(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p95": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * 1e3
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p95": float(p95), "p99": float(p99)}


def summarize(results: list[Result], wall_s: float) -> dict[str, Any]:
    """Latencies in ms (mean/p50/p95/p99), throughputs per second, errors with their first reasons."""
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "errors": len(errors),
        "error_reasons": sorted(set(errors))[:5], "duration_s": wall_s,
        "input_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out_tokens,
        "request_throughput": len(ok) / wall_s if wall_s else 0.0,
        "output_throughput": out_tokens / wall_s if wall_s else 0.0,
        "ttft_ms": _dist([r.ttft_s for r in ok]), "itl_ms": _dist([x for r in ok for x in r.itl_s]),
        "e2e_ms": _dist([r.e2e_s for r in ok]),
        "tpot_ms": _dist([(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
    }
