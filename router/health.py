"""Periodic health checks (GET /health) and served-model discovery (GET /v1/models)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from pdsdk.router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)


async def check(session: aiohttp.ClientSession, w: Worker, timeout: float, threshold: int = 1) -> None:
    """One check. A worker that refuses the connection is out at once; one that is merely slow or
    answers non-200 is out after `threshold` such checks in a row (a busy engine answers late)."""
    t = aiohttp.ClientTimeout(total=timeout)
    refused = False
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
        refused = isinstance(e, aiohttp.ClientConnectorError)
        w.last_error = f"health: {type(e).__name__}: {e}"
    w.health_failures = 0 if ok else w.health_failures + 1
    if not ok and w.healthy and not refused and w.health_failures < threshold:
        log.info("worker %s (%s) failed %d health check(s) in a row: %s", w.url, w.role, w.health_failures,
                 w.last_error)
        ok = True  # not out yet
    if ok != w.healthy:
        log.warning("worker %s (%s) is now %s", w.url, w.role, "healthy" if ok else "UNHEALTHY")
        if ok:
            w.breaker.record(True)  # recovered: give it traffic again at once
    w.healthy = ok


async def check_all(session: aiohttp.ClientSession, pool: WorkerPool, timeout: float, threshold: int = 1) -> None:
    await asyncio.gather(*(check(session, w, timeout, threshold) for w in list(pool.workers.values())))


async def loop(session: aiohttp.ClientSession, pool: WorkerPool, interval: float, timeout: float,
               threshold: int) -> None:
    while True:
        await check_all(session, pool, timeout, threshold)
        await asyncio.sleep(interval)
