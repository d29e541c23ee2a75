"""The router's site accepts every pending connection when its socket wakes up: under uvloop a busy
loop used to accept one per turn (500 connections opened at once waited ~10 s for their first answer)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from aiohttp import web

from pdsdk.router.http.client_log import ThrottledLog
from pdsdk.router.http.gate import Gate, GateSite

BURST = 300


async def _turns_to_admit(burst: int) -> int:
    runner = web.AppRunner(web.Application())
    await runner.setup()
    gate = Gate(4096, 4096, 15.0, ThrottledLog())
    site = GateSite(runner, "127.0.0.1", 0, gate)
    await site.start()
    port = runner.addresses[0][1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(burst)]  # the kernel completes them
    try:
        turns = 0
        while gate.total < burst and turns < 100:
            time.sleep(0.002)  # each turn of a busy loop costs time
            await asyncio.sleep(0)
            turns += 1
        assert gate.total == burst
        return turns
    finally:
        for c in clients:
            c.close()
        await runner.cleanup()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_burst_of_connections_is_accepted_in_a_few_turns_of_a_busy_loop(loop):
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        assert uvloop.run(_turns_to_admit(BURST)) <= 5
    else:
        assert asyncio.run(_turns_to_admit(BURST)) <= 5


def test_a_site_on_a_taken_port_fails_to_start():
    async def main():
        taken = socket.create_server(("127.0.0.1", 0))
        runner = web.AppRunner(web.Application())
        await runner.setup()
        try:
            with pytest.raises(OSError):
                await GateSite(runner, "127.0.0.1", taken.getsockname()[1], Gate(8, 8, 1.0, ThrottledLog())).start()
        finally:
            taken.close()
            await runner.cleanup()
    asyncio.run(main())
