"""Health checks: a slow or failing worker is out only after --health-failures checks in a row,
a worker that refuses connections is out at once."""

from __future__ import annotations

import asyncio

import aiohttp

from pdsdk.ports import free_port
from pdsdk.router import health
from pdsdk.router.workers import Worker
from pdsdk.testing.fake_worker import FakeWorker


async def _checks(w: Worker, n: int, timeout: float = 0.2, threshold: int = 3) -> list[bool]:
    async with aiohttp.ClientSession() as s:
        out = []
        for _ in range(n):
            await health.check(s, w, timeout, threshold)
            out.append(w.healthy)
        return out


def test_a_slow_worker_stays_in_until_it_misses_threshold_checks_in_a_row():
    async def main():
        fake = await FakeWorker().start()
        try:
            w = Worker(fake.url)
            fake.health_delay_s = 0.5
            assert await _checks(w, 3) == [True, True, False]
            assert "TimeoutError" in w.last_error
            fake.health_delay_s = 0.0
            assert await _checks(w, 1) == [True]  # back at the first good answer
            fake.health_delay_s = 0.5
            assert await _checks(w, 2) == [True, True]  # the count started over
            fake.health_delay_s, fake.healthy = 0.0, False
            assert await _checks(w, 1) == [False]  # a third miss in a row, a 503 this time
        finally:
            await fake.stop()
    asyncio.run(main())


def test_a_worker_that_refuses_connections_is_out_at_once():
    w = Worker(f"http://127.0.0.1:{free_port()}")
    assert asyncio.run(_checks(w, 1)) == [False]
    assert "ClientConnectorError" in w.last_error
