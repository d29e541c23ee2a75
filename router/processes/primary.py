"""The router's one worker set, kept by the parent of its serving processes as a single-process
router keeps it (static list, admin changes, etcd, one health checker). Each change goes out to
every process as a numbered snapshot; the current one goes out again to a process that subscribes
(one that starts or restarts), and every second. Admin changes come in from the process that took
the request."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Callable

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from pdsdk.router.config import RouterConfig
from pdsdk.router.processes.link import endpoint
from pdsdk.router.processes.load_table import LoadTable
from pdsdk.router.processes.messages import (AddWorker, DrainWorker, Ready, RemoveWorker, Reply, Snapshot,
                                             WorkerRecord, decode_call, encode)
from pdsdk.router.worker_set import AdminError, WorkerSet, admin_worker
from pdsdk.router.workers import WorkerPool

log = logging.getLogger(__name__)
CHECK_S = 0.1  # how often the worker set is compared with the last snapshot (health checks change it)
RESEND_EVERY = 10  # checks: the current snapshot goes out again this often


class Primary:
    def __init__(self, cfg: RouterConfig, state_dir: str, table: LoadTable,
                 on_ready: Callable[[int, int], None]):
        self.cfg, self.state_dir = cfg, state_dir
        self.pool = WorkerPool()
        self.workers = WorkerSet(cfg, self.pool, table)
        self.on_ready = on_ready  # (process index, pid): a serving process listens
        self.seq = 0
        self._records: list[WorkerRecord] | None = None
        self._ctx = zmq.asyncio.Context()
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._pub = self._ctx.socket(zmq.XPUB)  # XPUB: a new subscriber is heard, and sent the set at once
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.bind(endpoint(self.state_dir, "snapshots"))
        self._control = self._ctx.socket(zmq.ROUTER)
        self._control.bind(endpoint(self.state_dir, "control"))
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=self.cfg.connect_timeout_s))
        await self.workers.start(self._session)
        self.publish()
        self.workers.spawn(self._answer_calls())
        self.workers.spawn(self._keep_publishing())
        self.workers.spawn(self._welcome())

    def publish(self, again: bool = True) -> int:
        """Send the worker set (a new seq when it changed; else only when `again`); its seq."""
        records = [WorkerRecord(w.url, w.role, w.bootstrap_port, w.kv_events, w.kv_replay, w.source, w.healthy,
                                w.draining, list(w.models), w.last_error, w.slot) for w in self.pool.workers.values()]
        changed = records != self._records
        if changed:
            self.seq, self._records = self.seq + 1, records
        if changed or again:
            self._pub.send(encode(Snapshot(self.seq, records)))
        return self.seq

    async def _keep_publishing(self) -> None:
        for n in itertools.count(1):
            await asyncio.sleep(CHECK_S)
            self.publish(again=n % RESEND_EVERY == 0)

    async def _welcome(self) -> None:
        while True:
            if (await self._pub.recv())[:1] == b"\x01":  # a subscription: a process (re)started
                self.publish()

    async def _answer_calls(self) -> None:
        while True:
            frames = await self._control.recv_multipart()
            if len(frames) != 3:
                continue
            peer, call_id, payload = frames
            try:
                reply = await self._answer(decode_call(payload))
            except msgspec.ValidationError as e:
                reply = Reply(400, error=str(e), seq=self.seq)
            except msgspec.DecodeError as e:
                log.warning("undecodable call from a serving process ignored: %s", e)
                continue
            if reply is not None:
                await self._control.send_multipart([peer, call_id, encode(reply)])

    async def _answer(self, call) -> Reply | None:
        if isinstance(call, Ready):
            self.on_ready(call.index, call.pid)
            return None
        try:
            if isinstance(call, AddWorker):
                w = admin_worker(self.cfg, call.url, call.role, call.bootstrap_port, call.kv_events, call.kv_replay)
                status, body = await self.workers.add(w)
            elif isinstance(call, RemoveWorker):
                status, body = await self.workers.remove(call.url)
            else:
                assert isinstance(call, DrainWorker)
                status, body = await self.workers.drain(call.url, call.remove)
        except AdminError as e:
            return Reply(e.status, error=str(e), seq=self.seq)
        return Reply(status, body, seq=self.publish(again=False))

    async def stop(self) -> None:
        await self.workers.stop()
        if self._session is not None:
            await self._session.close()
        self._ctx.destroy(linger=0)
