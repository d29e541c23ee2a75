"""Periodic health checks (GET /health) and served-model discovery (GET /v1/models)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from pdsdk.router import rmetrics
from pdsdk.router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)


async def check(session: aiohttp.ClientSession, w: Worker, timeout: float) -> None:
    t = aiohttp.ClientTimeout(total=timeout)
    try:
        async with session.get(w.url + "/health", timeout=t) as r:
            ok = r.status == 200
            await r.read()
        if ok and not w.models:
            async with session.get(w.url + "/v1/models", timeout=t) as r:
                if r.status == 200:
                    data = await r.json(content_type=None)
                    w.models = [m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
        ok = False
        w.last_error = f"health: {type(e).__name__}: {e}"
    if ok != w.healthy:
        log.warning("worker %s (%s) is now %s", w.url, w.role, "healthy" if ok else "UNHEALTHY")
        if ok:
            w.breaker.record(True)  # recovered: give it traffic again at once
    w.healthy = ok
    rmetrics.HEALTHY.labels(w.url, w.role).set(1 if ok else 0)
    rmetrics.BREAKER_OPEN.labels(w.url, w.role).set(1 if w.breaker.state == "open" else 0)


async def check_all(session: aiohttp.ClientSession, pool: WorkerPool, timeout: float) -> None:
    await asyncio.gather(*(check(session, w, timeout) for w in list(pool.workers.values())))


async def loop(session: aiohttp.ClientSession, pool: WorkerPool, interval: float, timeout: float) -> None:
    while True:
        await check_all(session, pool, timeout)
        await asyncio.sleep(interval)
