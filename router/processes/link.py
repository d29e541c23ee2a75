"""A serving process's line to the primary: the worker set comes in as snapshots, admin changes go
out (answered once this process holds the snapshot with the change)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os

import msgspec
import zmq
import zmq.asyncio

from pdsdk.router.breaker import CircuitBreaker
from pdsdk.router.processes.load_table import LoadTable
from pdsdk.router.processes.messages import (AddWorker, DrainWorker, Ready, RemoveWorker, Snapshot, WorkerRecord,
                                             decode_reply, decode_snapshot, encode)
from pdsdk.router.worker_set import AdminError
from pdsdk.router.workers import Worker

log = logging.getLogger(__name__)
FIRST_SNAPSHOT_S = 30.0  # the primary sends it when this process subscribes, and every second
CALL_TIMEOUT_S = 10.0


def endpoint(state_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(state_dir, name)}"


class Link:
    def __init__(self, state_dir: str, index: int, table: LoadTable):
        self.state_dir, self.index, self.table = state_dir, index, table
        self.seq = -1  # the snapshot this process holds
        self.router = None
        self._ctx = zmq.asyncio.Context()
        self._ids = itertools.count()
        self._task: asyncio.Task | None = None

    # --- snapshots in ---------------------------------------------------------------------
    async def start(self, router) -> None:
        """Connect, and hold the primary's worker set before the first client is served."""
        self.router = router
        self._applied = asyncio.Event()
        self._calls_lock = asyncio.Lock()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint(self.state_dir, "snapshots"))
        self._calls = self._ctx.socket(zmq.DEALER)
        self._calls.setsockopt(zmq.LINGER, 0)
        self._calls.connect(endpoint(self.state_dir, "control"))
        try:
            snap = await asyncio.wait_for(self._sub.recv(), FIRST_SNAPSHOT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(f"no worker set from the router's primary within {FIRST_SNAPSHOT_S:g} s") from None
        self._apply(decode_snapshot(snap))
        self._task = asyncio.ensure_future(self._follow())

    async def ready(self) -> None:
        await self._calls.send_multipart([b"", encode(Ready(self.index, os.getpid()))])

    async def _follow(self) -> None:
        while True:
            raw = await self._sub.recv()
            try:
                snap = decode_snapshot(raw)
                if snap.seq != self.seq:
                    self._apply(snap)
            except Exception:  # noqa: BLE001 - a bad snapshot must not end the process's updates
                log.exception("worker set snapshot not applied")

    def _apply(self, snap: Snapshot) -> None:
        pool = self.router.pool
        wanted = {r.url: r for r in snap.workers}
        for url in [u for u in pool.workers if u not in wanted]:
            pool.remove(url)
        for r in snap.workers:
            w = pool.get(r.url)
            if w is None or (w.role, w.bootstrap_port, w.kv_events, w.kv_replay, w.slot) != \
                    (r.role, r.bootstrap_port, r.kv_events, r.kv_replay, r.slot):
                if w is not None:
                    pool.remove(r.url)
                w = pool.add(self._worker(r))
            if r.healthy and not w.healthy:
                w.breaker.record(True)  # recovered: traffic again at once, as after a health check
            w.healthy, w.draining, w.source = r.healthy, r.draining, r.source
            w.models, w.last_error = list(r.models), r.last_error
        self.seq = snap.seq
        self._applied.set()
        self._applied = asyncio.Event()

    def _worker(self, r: WorkerRecord) -> Worker:
        cfg, table, slot = self.router.cfg, self.table, r.slot
        table.set_breaker(slot, "closed")
        breaker = CircuitBreaker(cfg.breaker_threshold, cfg.breaker_cooldown_s,
                                 on_change=lambda state: table.set_breaker(slot, state))
        return Worker(r.url, role=r.role, bootstrap_port=r.bootstrap_port, kv_events=r.kv_events,
                      kv_replay=r.kv_replay, source=r.source, breaker=breaker, table=table, slot=slot)

    # --- admin changes out ----------------------------------------------------------------
    async def add(self, w: Worker) -> tuple[int, dict]:
        return await self._call(AddWorker(w.url, w.role, w.bootstrap_port, w.kv_events, w.kv_replay))

    async def remove(self, url: str) -> tuple[int, dict]:
        return await self._call(RemoveWorker(url))

    async def drain(self, url: str, remove: bool) -> tuple[int, dict]:
        return await self._call(DrainWorker(url, remove))

    async def _call(self, msg) -> tuple[int, dict]:
        call_id = str(next(self._ids)).encode()
        loop = asyncio.get_running_loop()
        end = loop.time() + CALL_TIMEOUT_S
        async with self._calls_lock:  # one call at a time; a reply to an earlier, timed-out call is skipped
            await self._calls.send_multipart([call_id, encode(msg)])
            try:
                frames = []
                while frames[:1] != [call_id] or len(frames) != 2:
                    frames = await asyncio.wait_for(self._calls.recv_multipart(), end - loop.time())
            except asyncio.TimeoutError:
                raise AdminError(503, "the router's primary process did not answer; retry") from None
        try:
            reply = decode_reply(frames[1])
        except msgspec.DecodeError as e:
            raise AdminError(500, f"bad answer from the router's primary process: {e}") from None
        await self._until(reply.seq)
        if reply.error is not None:
            raise AdminError(reply.status, reply.error)
        return reply.status, reply.body

    async def _until(self, seq: int) -> None:
        """Wait (briefly) until this process holds snapshot `seq`: its next request sees the change."""
        loop = asyncio.get_running_loop()
        end = loop.time() + CALL_TIMEOUT_S
        while self.seq < seq and loop.time() < end:
            try:
                await asyncio.wait_for(self._applied.wait(), end - loop.time())
            except asyncio.TimeoutError:
                break

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._ctx.destroy(linger=0)
