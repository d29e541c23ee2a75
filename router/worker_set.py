"""The workers a router serves and everything that changes them: the static list, the admin API,
etcd discovery and health checks.

A router has one: in its only process, or in the primary of `pdsdk router --processes N`, which
shares it with the serving processes (processes/primary.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from pdsdk.errors import ConfigError
from pdsdk.router import health
from pdsdk.router.breaker import CircuitBreaker
from pdsdk.router.config import RouterConfig
from pdsdk.router.workers import Worker, WorkerPool, parse_worker_arg

log = logging.getLogger(__name__)


class AdminError(Exception):
    """An admin request that cannot be done: its HTTP status and why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def admin_worker(cfg: RouterConfig, url: str, role: Any = None, bootstrap_port: Any = None, kv_events: Any = None,
                 kv_replay: Any = None) -> Worker:
    """A worker the admin API was asked to add, checked (AdminError 400 says what is wrong)."""
    try:
        w = Worker(url, role=role or ("plain" if not cfg.pd else ""), source="admin", bootstrap_port=bootstrap_port,
                   kv_events=kv_events, kv_replay=kv_replay)
    except ConfigError as e:
        raise AdminError(400, str(e)) from None
    if (w.role == "plain") == cfg.pd:
        raise AdminError(400, f"role {w.role!r} does not fit a router in {'PD' if cfg.pd else 'plain'} mode "
                              "(use prefill/decode in PD mode, plain otherwise)")
    return w


class WorkerSet:
    def __init__(self, cfg: RouterConfig, pool: WorkerPool, table=None):
        self.cfg, self.pool = cfg, pool
        self.table = table  # the processes' shared load table: each worker gets a slot in it
        self.session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()
        self._next_slot = 0
        pool.listeners.append(self._on_change)

    # --- membership -----------------------------------------------------------------------
    def static_workers(self) -> list[Worker]:
        cfg = self.cfg
        specs = [(u, "plain") for u in cfg.workers] + [(u, "prefill") for u in cfg.prefill] + \
                [(u, "decode") for u in cfg.decode]
        out = []
        for spec, role in specs:
            w = parse_worker_arg(spec, role)
            w.kv_events, w.kv_replay = cfg.kv_events.get(w.url), cfg.kv_replay.get(w.url)
            out.append(w)
        return out

    def add_worker(self, w: Worker) -> Worker:
        w.breaker = CircuitBreaker(self.cfg.breaker_threshold, self.cfg.breaker_cooldown_s)
        if self.table is not None:
            w.table, w.slot = self.table, self._free_slot()
        return self.pool.add(w)

    def _free_slot(self) -> int:
        """A column of the load table no worker holds and no request still counts in: taken in turn,
        so a slot is used again only after all the others."""
        from pdsdk.router.processes.load_table import SLOTS

        held = {w.slot for w in self.pool.workers.values()}
        for i in range(SLOTS):
            slot = (self._next_slot + i) % SLOTS
            if slot not in held and self.table.total(slot) == 0:
                self._next_slot = slot + 1
                return slot
        raise AdminError(503, f"the router serves its limit of {SLOTS} workers")

    def _on_change(self, event: str, w: Worker) -> None:
        if event == "add":
            log.info("worker %s joined as %s (%s)", w.url, w.role, w.source)
            if self.session is not None:  # check it now rather than at the next round
                self.spawn(health.check(self.session, w, self.cfg.health_timeout_s, self.cfg.health_failures))
        else:
            log.info("worker %s (%s) left", w.url, w.role)

    # --- admin API ------------------------------------------------------------------------
    async def add(self, w: Worker) -> tuple[int, dict]:
        return 201, self.add_worker(w).describe()

    async def remove(self, url: str) -> tuple[int, dict]:
        w = self.pool.remove(url)
        if w is None:
            raise AdminError(404, f"no worker {url[:200]!r}")
        return 200, w.describe()

    async def drain(self, url: str, remove: bool) -> tuple[int, dict]:
        w = self.pool.get(url)
        if w is None:
            raise AdminError(404, f"no worker {url[:200]!r}")
        w.draining = True
        if remove:
            self.spawn(self._remove_when_idle(w))
        return 200, w.describe()

    async def _remove_when_idle(self, w: Worker, poll_s: float = 0.05) -> None:
        while w.load > 0 and w.draining and self.pool.get(w.url) is w:
            await asyncio.sleep(poll_s)
        if w.draining and self.pool.get(w.url) is w:
            self.pool.remove(w.url)

    # --- background work ------------------------------------------------------------------
    async def start(self, session: aiohttp.ClientSession) -> None:
        """Add the static workers, check them once, then keep checking; follow etcd if set."""
        cfg = self.cfg
        self.session = session
        for w in self.static_workers():
            self.add_worker(w)
        await health.check_all(session, self.pool, cfg.health_timeout_s, cfg.health_failures)
        self.spawn(health.loop(session, self.pool, cfg.health_interval_s, cfg.health_timeout_s, cfg.health_failures))
        if cfg.etcd:
            from pdsdk.router.etcd import watch_workers

            self.spawn(watch_workers(self, cfg.etcd, cfg.etcd_prefix))

    def spawn(self, coro) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
