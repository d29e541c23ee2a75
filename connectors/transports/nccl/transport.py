"""`nccl`: torch.distributed point-to-point between pairs of peers that meet at run time.

There is no global world: every side hosts a TCPStore, and a side that connects forms a 2-rank
group with its peer under a prefix of the peer's store (initiator rank 1, acceptor rank 0).
Groups are NCCL when the registered regions are on GPU, gloo when they are on the host.

torch.distributed is two-sided, so one-sided reads and writes ride on a control channel: the
initiator posts its half and asks the acceptor to post the other (READ: "send" these spans;
WRITE: "recv" into these spans, then "ack"). send/recv move contiguous tensors only, so scattered
spans are gathered into (or scattered from) a staging buffer, in chunks of `chunk_mb` (4 MiB on
host), each its own send/recv under its own tag: the sender packs chunk i+1 while chunk i is on the
wire and the receiver unpacks chunk i while i+1 arrives. One after the other, gather + send + scatter
ran scattered pages at 0.36-0.44 of the contiguous rate on two CPU cores.

Gloo send/recv work reports completion only through a blocking `wait()`, so each pending
operation has a daemon thread waiting on it with the transfer deadline; `poll` reads its result.
Gloo can miss a peer that dies mid-message, so each side also holds an idle TCP connection to
the other's store port, watched for the close that the kernel does when a process dies.
A failed transfer breaks its pair: the group is aborted (pending operations on both sides fail at
once, nothing lands late) and later transfers with that peer fail fast.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pdsdk.connectors.transports.base import Transport
from pdsdk.connectors.transports.common.buffers import cuda_index
from pdsdk.connectors.transports.common.control import ControlChannel
from pdsdk.connectors.transports.common.descriptor import Descriptor, Peer
from pdsdk.connectors.transports.common.status import FAILED, STATUS_DONE, STATUS_PENDING, TransferStatus, failed
from pdsdk.connectors.transports.nccl.buffers import SpanTensors
from pdsdk.connectors.transports.nccl.pairs import Op, Pair, Serial, chunk_bounds, short_reason
from pdsdk.errors import TransportError
from pdsdk.kv import Region, check_spans, split_spans

log = logging.getLogger(__name__)

KILL_TAG = 2**31 - 1  # never a transfer's tag: a receive on it that times out aborts a gloo group


class NcclTransport(Transport):
    OPTIONS = {
        "staging_mb": 512,  # free staging buffers kept for reuse, in MiB
        # Scattered transfers move in chunks of this many MiB (pipelined: see the module docstring).
        # Default: 4 on host; one chunk on GPUs, where one gather kernel runs at several times the
        # link's speed, so overlapping it saves little and every extra NCCL operation costs a launch.
        "chunk_mb": None,
    }

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._backend = "gloo"
        self._notes: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        self._pairs: dict[str, Pair] = {}
        self._pairs_lock = threading.Lock()
        self._tensors = SpanTensors(int(self.options["staging_mb"]) << 20)
        # Port 0: the OS picks; peers learn the real one from the descriptor.
        self._store = dist.TCPStore(self.host, 0, None, True, timedelta(seconds=self.connect_timeout_s),
                                    wait_for_workers=False)
        self._control = ControlChannel(self.agent, self.host, self._on_message)
        self._waiters: set[threading.Thread] = set()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name=f"pdsdk-nccl-watch-{self.agent}",
                                          daemon=True)
        self._watchdog.start()

    def _path(self) -> str:
        return self._backend

    def _register(self, regions: list[Region]) -> None:
        on_gpu = {cuda_index(r.device) is not None for r in self.regions + regions}
        if len(on_gpu) > 1:
            raise TransportError("nccl: register host regions or GPU regions, not both (a pair group is gloo "
                                 "or NCCL)")
        if True in on_gpu and not dist.is_nccl_available():
            raise TransportError("nccl: GPU regions need torch with NCCL; this torch has none")
        self._backend = "nccl" if True in on_gpu else "gloo"
        self._tensors.add(regions)

    def _metadata(self) -> dict[str, Any]:
        return {"store_port": self._store.port, "control": self._control.address, "backend": self._backend,
                "gpus": self._gpu_uuids()}

    def _gpu_uuids(self) -> list[str]:
        devices = {cuda_index(r.device) for r in self.regions} - {None}
        return sorted(str(torch.cuda.get_device_properties(i).uuid) for i in devices)

    # --- pairs ----------------------------------------------------------------------------------

    def _connect(self, d: Descriptor, peer: Peer) -> Any:
        if d.meta.get("backend") != self._backend:
            raise TransportError(f"nccl: peer {d.agent} registered {d.meta.get('backend')} memory, this side "
                                 f"{self._backend}; register both sides on GPU or both on host")
        shared = set(d.meta.get("gpus", [])) & set(self._gpu_uuids())
        if shared:
            raise TransportError(f"nccl: peer {d.agent} uses the same GPU as this side ({sorted(shared)[0]}); NCCL "
                                 "cannot pair two ranks on one GPU: use transport 'local' (CUDA IPC) there")
        pair = Pair(uuid.uuid4().hex, d.agent, d.meta["control"], rank=1)
        self._control.send(pair.control, {"op": "hello", "pair": pair.id, "agent": self.agent,
                                          "control": self._control.address, "host": self.host,
                                          "store_port": self._store.port})
        try:
            store = dist.TCPStore(d.host, d.meta["store_port"], None, False,
                                  timedelta(seconds=self.connect_timeout_s), wait_for_workers=False)
            pair.pg = self._new_group(store, pair)
            pair.ping = self._ping((d.host, d.meta["store_port"]))
        except Exception as e:  # noqa: BLE001
            raise TransportError(f"nccl: no pair group with {d.agent} at {d.host}:{d.meta['store_port']} "
                                 f"within {self.connect_timeout_s:g}s ({short_reason(e)})") from None
        with self._pairs_lock:
            self._pairs[pair.id] = pair
        return pair

    def _new_group(self, store: Any, pair: Pair) -> Any:
        """The pair's group; gloo blocks here until both sides joined, NCCL joins at its first operation."""
        prefixed = dist.PrefixStore(f"pair/{pair.id}", store)
        if self._backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=self.connect_timeout_s)  # bounds the join; waits have their own
            opts._threads = 1  # worker threads serve collectives only; send/recv never use them
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
            return dist.ProcessGroupGloo(prefixed, pair.rank, 2, opts)
        # On a timed-out operation abort the communicator but keep the process (the default tears it down).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timedelta(seconds=self.transfer_timeout_s)
        return dist.ProcessGroupNCCL(prefixed, pair.rank, 2, opts)

    def _break(self, pair: Pair, reason: str | None, quiet: bool = False) -> None:
        """A failed operation may leave the peer's half posted: the pair cannot be trusted any more."""
        if pair.broken is None:
            pair.broken = reason or "failed"
            (log.debug if quiet else log.warning)("nccl: pair with %s broken: %s", pair.agent, pair.broken)
        with self._pairs_lock:
            self._pairs.pop(pair.id, None)
        self._abort(pair)
        if pair.ping is not None:
            pair.ping.close()
        if pair.serial is not None:
            pair.serial.close()
            pair.pg = None

    def _abort(self, pair: Pair) -> None:
        """Fail every pending operation of the pair's group, here and at the peer (its connection closes)."""
        pg = pair.pg
        if pg is None:
            return
        try:
            if self._backend == "nccl":
                pg.abort()
            else:  # gloo's abort() leaves waits blocked, but a timed-out wait closes the group's connections
                work = pg.recv([torch.empty(1, dtype=torch.uint8)], pair.peer_rank, KILL_TAG)
                work.wait(timedelta(milliseconds=1))
        except Exception:  # noqa: BLE001 - expected: that is how it aborts
            pass

    def _ping(self, address: tuple[str, int]) -> socket.socket:
        sock = socket.create_connection(address, self.connect_timeout_s)
        sock.setblocking(False)
        return sock

    def _watch(self) -> None:
        """Break pairs whose peer process is gone. Never blocks for long (close joins it)."""
        while not self._stop.is_set():
            with self._pairs_lock:
                pings = {p.ping.fileno(): p for p in self._pairs.values() if p.ping is not None}
            pings.pop(-1, None)  # closed by a concurrent _break
            if not pings:
                self._stop.wait(0.1)
                continue
            poller = select.poll()
            for fd in pings:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(100):
                pair = pings[fd]
                try:  # the store never writes to a connection that sent nothing: readable means closed
                    gone = pair.ping.recv(4096) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:  # worth a warning only when it costs transfers
                    self._break(pair, f"peer {pair.agent} is gone (connection to its store closed)",
                                quiet=not pair.ops)

    def _check_pair(self, pair: Pair) -> None:
        if pair.broken is not None:
            raise TransportError(f"nccl: pair with {pair.agent} is broken ({pair.broken}); connect again")

    # --- initiator ------------------------------------------------------------------------------

    def _post(self, op: str, peer: Peer, local: np.ndarray, remote: np.ndarray, notify: bytes | None) -> Any:
        pair: Pair = peer.backend
        self._check_pair(pair)
        o = Op(op, pair, notify)
        deadline = time.monotonic() + self.transfer_timeout_s
        local, remote, bounds = self._chunked(local, remote)
        buf, o.staging = self._tensors.contiguous(local)
        parts = self._tensors.parts(local, bounds, buf)
        # Spans as raw int64 (thousands of pages: a list costs ms to encode and decode, this us); the
        # peer cuts them into the same chunks.
        request = {"op": "send" if op == "READ" else "recv", "pair": pair.id,
                   "spans": remote.astype("<i8").tobytes(), "bounds": bounds}
        if op == "WRITE" and notify is not None:
            request["notify"] = notify
        works: list[Any] = []
        try:
            with pair.lock:  # chunks of one transfer post back to back: NCCL matches operations by order
                self._check_pair(pair)
                o.tag = request["tag"] = pair.take_tags(len(parts))
                pair.ops[o.tag] = o
                # Request first: NCCL's first operation blocks until the peer posts its own.
                self._control.send(pair.control, request)
                for i, (spans, part) in enumerate(parts):
                    if op == "READ":  # every receive posted now; the waiter unpacks them as they land
                        works.append(pair.pg.recv([part], pair.peer_rank, o.tag + i))
                        continue
                    if o.staging is not None:
                        self._tensors.pack(spans, part)  # while the chunks before it are on the wire
                    works.append(pair.pg.send([part], pair.peer_rank, o.tag + i))
        except Exception as e:
            pair.ops.pop(o.tag, None)
            if not works:  # else a posted chunk may still use it: left to the garbage collector
                self._tensors.pool.put(o.staging)
            if isinstance(e, TransportError):
                raise
            self._break(pair, short_reason(e))
            raise TransportError(f"nccl: {short_reason(e)}") from None
        unpack = parts if op == "READ" and o.staging is not None else None
        o.future = self._background(self._settle, o, works, deadline, unpack)
        return o

    def _background(self, fn: Callable, *args: Any) -> Future:
        """Run fn on a daemon thread (a gloo wait must not hold up interpreter exit); close() joins them."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001
                future.set_exception(e)
            finally:
                self._waiters.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=f"pdsdk-nccl-wait-{self.agent}", daemon=True)
        self._waiters.add(thread)
        thread.start()
        return future

    def _settle(self, o: Op, works: list[Any], deadline: float, unpack: list | None) -> None:
        def landed(i: int) -> None:
            with o.lock:
                if unpack is not None and not o.abandoned:
                    self._tensors.pack(*unpack[i], out=True)

        self._drain(o.pair, works, deadline, landed)

    def _drain(self, pair: Pair, works: list[Any], deadline: float, landed: Callable[[int], None]) -> None:
        """Wait for the chunks in order, calling landed(i) once chunk i is done (unpacking chunk i
        while later chunks are still moving). A failed chunk breaks the pair first, aborting the
        group, so the chunks after it fail at once instead of landing in a buffer being reused."""
        for i, work in enumerate(works):
            try:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.01)))  # raises on failure
                landed(i)
            except Exception as e:
                self._break(pair, short_reason(e))
                for rest in works[i + 1:]:
                    with contextlib.suppress(Exception):  # expected: the abort fails them
                        rest.wait(timedelta(seconds=1))
                raise

    def _poll(self, o: Op) -> TransferStatus:
        pair = o.pair
        if o.ack is not None and not o.ack[0]:
            return failed(f"peer {pair.agent}: {o.ack[1]}")
        ok = o.future.done() and o.future.exception() is None
        if ok and (o.op == "READ" or o.ack is not None):  # a WRITE is done once the peer has the bytes
            if o.op == "READ" and o.notify is not None:
                self._control.send(pair.control, {"op": "notify", "msg": o.notify})
            return STATUS_DONE
        if pair.broken:  # breaking aborts the group, failing our wait too: name the cause, not the abort
            return failed(f"pair with {pair.agent} broken: {pair.broken}")
        if o.future.done() and not ok:
            return failed(short_reason(o.future.exception()))
        return STATUS_PENDING

    def _release(self, o: Op | None, status: TransferStatus) -> None:
        if o is None:
            return
        o.pair.ops.pop(o.tag, None)
        if status.state == FAILED:
            self._break(o.pair, status.reason, quiet=self._closed)
        with o.lock:
            o.abandoned = True
            if o.future is not None and o.future.done():
                self._tensors.pool.put(o.staging)  # a buffer still posted is left to the garbage collector
            o.staging = o.future = None

    # --- acceptor -------------------------------------------------------------------------------

    def _on_message(self, sender: str, m: dict[str, Any]) -> None:
        op = m.get("op")
        if op == "notify":
            self._notes.put((sender, m["msg"]))
            return
        if op == "hello":
            pair = Pair(m["pair"], m["agent"], m["control"], rank=0,
                         serial=Serial(f"pdsdk-nccl-{m['agent']}"))
            with self._pairs_lock:
                self._pairs[pair.id] = pair
            pair.serial.submit(self._accept, pair, (m["host"], m["store_port"]))  # blocks: not on this thread
            return
        with self._pairs_lock:
            pair = self._pairs.get(m.get("pair"))
        if op in ("send", "recv"):
            if pair is None or pair.rank != 0:
                # Broken here, so the initiator already had a failed ack (or its deadline) for this pair.
                log.warning("nccl: %s asked to %s on unknown pair %s", sender, op, m.get("pair"))
                return
            pair.serial.submit(self._serve, pair, m)
        elif op == "ack" and pair is not None:
            o = pair.ops.get(m["tag"])
            if o is not None:
                o.ack = (bool(m["ok"]), m.get("error"))
                if not o.ack[0]:
                    self._break(pair, f"peer {pair.agent}: {o.ack[1]}")
        elif op == "bye" and pair is not None:
            self._break(pair, "peer closed the pair", quiet=True)

    def _accept(self, pair: Pair, peer_store: tuple[str, int]) -> None:
        try:
            pair.pg = self._new_group(self._store, pair)
            pair.ping = self._ping(peer_store)  # so a dead initiator does not leave its pair here for good
        except Exception as e:  # noqa: BLE001
            self._break(pair, f"{pair.agent} did not join within {self.connect_timeout_s:g}s ({short_reason(e)})")

    def _serve(self, pair: Pair, m: dict[str, Any]) -> None:
        """Post our half of one request (on the pair's serial thread, so the chunks of one request
        post back to back); a waiter finishes it. Sending packs chunk i+1 while chunk i moves."""
        tag = m["tag"]
        staging = None
        works: list[Any] = []
        try:
            self._check_pair(pair)
            spans = np.frombuffer(m["spans"], dtype="<i8").reshape(-1, 3).astype(np.int64)
            spans = check_spans(spans, self.regions, "requested")
            bounds = m.get("bounds", [0, len(spans)])
            if bounds[0] != 0 or bounds[-1] != len(spans) or any(a >= b for a, b in itertools.pairwise(bounds)):
                raise TransportError(f"chunk bounds {bounds[:4]}... do not cut {len(spans)} spans")
            buf, staging = self._tensors.contiguous(spans)
            parts = self._tensors.parts(spans, bounds, buf)
            for i, (chunk, part) in enumerate(parts):
                if m["op"] == "send":
                    if staging is not None:
                        self._tensors.pack(chunk, part)
                    works.append(pair.pg.send([part], pair.peer_rank, tag + i))
                else:
                    works.append(pair.pg.recv([part], pair.peer_rank, tag + i))
        except Exception as e:  # noqa: BLE001
            if not works:  # else a posted chunk may still use it: left to the garbage collector
                self._tensors.pool.put(staging)
            self._fail_request(pair, tag, e)
            return
        unpack = parts if m["op"] == "recv" and staging is not None else None
        self._background(self._complete, pair, m, works, staging, unpack)

    def _complete(self, pair: Pair, m: dict[str, Any], works: list[Any], staging: Any, unpack: list | None) -> None:
        def landed(i: int) -> None:
            if unpack is not None:
                self._tensors.pack(*unpack[i], out=True)

        try:
            self._drain(pair, works, time.monotonic() + self.transfer_timeout_s, landed)
            if m["op"] == "recv":
                if m.get("notify") is not None:
                    self._notes.put((pair.agent, m["notify"]))
                self._ack(pair, m["tag"], True)
            self._tensors.pool.put(staging)  # only now: after a failure a chunk may still be posted
        except Exception as e:  # noqa: BLE001
            self._fail_request(pair, m["tag"], e)

    def _fail_request(self, pair: Pair, tag: int, e: BaseException) -> None:
        reason = short_reason(e)
        self._break(pair, reason)
        self._ack(pair, tag, False, reason)  # the initiator fails now instead of at its deadline

    def _ack(self, pair: Pair, tag: int, ok: bool, error: str | None = None) -> None:
        if not self._closed:
            self._control.send(pair.control,
                               {"op": "ack", "pair": pair.id, "tag": tag, "ok": ok, "error": error})

    # --- chunks --------------------------------------------------------------------------------

    def _chunked(self, local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Spans cut to at most one chunk per row, and the chunk bounds (row indices) of the transfer."""
        mb = self.options["chunk_mb"]
        if mb is None:
            mb = 4 if self._backend == "gloo" else 0
        chunk = int(float(mb) * (1 << 20))
        if chunk and len(local) > 1:  # one run needs no staging, so nothing to overlap
            local, remote = split_spans(local, remote, chunk)
        return local, remote, chunk_bounds(local, chunk)

    # --- the rest -------------------------------------------------------------------------------

    def _notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while not self._notes.empty():
            out.append(self._notes.get_nowait())
        return out

    def _extra_stats(self) -> dict[str, Any]:
        with self._pairs_lock:
            pairs = list(self._pairs.values())
        return {"pairs": len(pairs), "initiated": sum(p.rank == 1 for p in pairs)}

    def _close(self) -> None:
        self._stop.set()
        with self._pairs_lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            if pair.rank == 1 and pair.broken is None:
                self._control.send(pair.control, {"op": "bye", "pair": pair.id})  # best effort
            self._break(pair, "transport closed", quiet=True)  # aborts: pending waits return now
        self._control.close()
        end = time.monotonic() + 2
        for thread in [*self._waiters.copy(), self._watchdog, *(p.serial.thread for p in pairs if p.serial)]:
            thread.join(max(0.0, end - time.monotonic()))
        for pair in pairs:
            pair.pg = None  # no global teardown: there is no default group
        self._tensors.pool.clear()
        self._store = None
