"""A router with fake workers in one event loop, for tests and `pdsdk bench router`."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from pdsdk import hookimpl, plugins
from pdsdk.router.config import RouterConfig
from pdsdk.router.server import Router, start
from pdsdk.testing.fake_worker import FakeWorker


class Harness:
    """`async with Harness(engine="vllm", prefill=1, decode=1, policy="round_robin") as h:`
    h.url is the router; h.prefill / h.decode / h.plain are FakeWorkers."""

    def __init__(self, engine: str = "vllm", plain: int = 0, prefill: int = 0, decode: int = 0,
                 worker_opts: dict[str, Any] | None = None, **cfg: Any):
        self.engine, self.counts, self.worker_opts, self.cfg_kw = engine, (plain, prefill, decode), worker_opts, cfg
        self.plain: list[FakeWorker] = []
        self.prefill: list[FakeWorker] = []
        self.decode: list[FakeWorker] = []
        self.router: Router | None = None
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Harness:
        opts = self.worker_opts or {}
        for role, n, dst in zip(("plain", "prefill", "decode"), self.counts, (self.plain, self.prefill, self.decode)):
            for _ in range(n):
                dst.append(await FakeWorker(self.engine, role, **opts).start())
        cfg = RouterConfig(port=0, engine=self.engine, workers=[w.url for w in self.plain],
                           prefill=[w.url for w in self.prefill], decode=[w.url for w in self.decode],
                           **{"health_interval_s": 0.2, "health_timeout_s": 0.5, **self.cfg_kw})
        self.router, self._runner, self.port = await start(cfg)
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()
        await self._runner.cleanup()
        for w in self.plain + self.prefill + self.decode:
            await w.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def workers(self) -> list[FakeWorker]:
        return self.plain + self.prefill + self.decode

    async def post(self, path: str, body: Any = None, *, raw: bytes | None = None, headers=None,
                   timeout: float = 10.0) -> tuple[int, Any, dict]:
        """(status, parsed JSON or text, headers)."""
        data = raw if raw is not None else None
        kw = {"data": data} if raw is not None else {"json": body}
        async with self.session.post(self.url + path, headers=headers or {}, timeout=aiohttp.ClientTimeout(timeout),
                                     **kw) as r:
            text = await r.text()
            try:
                import json

                return r.status, json.loads(text), {k.lower(): v for k, v in r.headers.items()}
            except ValueError:
                return r.status, text, {k.lower(): v for k, v in r.headers.items()}

    async def get(self, path: str, headers=None) -> tuple[int, Any]:
        async with self.session.get(self.url + path, headers=headers or {}) as r:
            text = await r.text()
            try:
                import json

                return r.status, json.loads(text)
            except ValueError:
                return r.status, text


async def eventually(check, timeout: float = 5.0, step: float = 0.02) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if check():
            return True
        await asyncio.sleep(step)
    return bool(check())


class Decisions:
    """The router's choices by request id, `(worker url, reason)`, through the pdsdk_route_decision
    hook: `with Decisions() as seen:` ... `seen[request_id]`."""

    def __init__(self):
        self.seen: dict[str, tuple[str, str]] = {}

    @hookimpl
    def pdsdk_route_decision(self, policy, request_id, role, worker, reason):
        self.seen[request_id] = (worker, reason)

    def __enter__(self) -> dict[str, tuple[str, str]]:
        plugins.plugin_manager().register(self)
        return self.seen

    def __exit__(self, *exc) -> None:
        plugins.plugin_manager().unregister(self)
