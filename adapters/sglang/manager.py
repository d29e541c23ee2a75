"""PdsdkKVManager: SGLang's CommonKVManager moving pages with any pdsdk transport.

SGLang's flow (disaggregation/prefill.py and decode.py) is push: the decode manager registers its buffers
with each prefill rank once, then sends per request the destination pages and metadata slot; the
prefill scheduler hands finished chunks to `add_transfer_request`, and this manager writes them
into decode memory, then tells decode Success or Failed (with the reason) on decode's control
socket. What CommonKVManager already does is kept: the bootstrap server registration, prefill
topology lookup, request status table, heartbeats to prefill (a dead prefill fails its rooms).

Threads: prefill runs one control thread (registrations, requests, aborts) and one transfer
thread (posts each chunk and waits for it within the transport's deadline); decode runs one
listener thread for statuses, plus CommonKVManager's heartbeat thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode

from pdsdk.adapters.common.refusals import Refusals
from pdsdk.adapters.sglang import wire
from pdsdk.adapters.sglang.geometry import kv_regions, layout_from_kv_args, transfer_spans
from pdsdk.adapters.sglang.settings import config_from_env
from pdsdk.compat import sglang as compat
from pdsdk.connectors.transports.factory import open_transport

log = logging.getLogger(__name__)
_STOP = object()
MAX_MESSAGE_BYTES = 64 << 20  # a control message: a transport descriptor or a request's page list


@dataclass
class _DecodePeer:
    reg: wire.Registration
    problem: str | None = None  # why this peer cannot be served (shape/TP mismatch): fails its rooms
    peer: Any = None  # the connected transport peer, made on first use (transfer thread)


@dataclass
class _Chunk:
    room: int
    pages: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: int | None
    has_state: bool


@dataclass
class _RoomProgress:
    started: float = field(default_factory=time.perf_counter)
    bytes: int = 0


class PdsdkKVManager(CommonKVManager):
    # Cleared rooms and aborts are handled here; SGLang's deferred-release ACK protocol is not spoken.
    supports_deferred_decode_kv_release = False

    def __init__(self, args: Any, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False, **_: Any):
        compat.check_supported()
        self.pdsdk_config = config_from_env()  # before any socket: a bad config stops the start
        self._stop = threading.Event()
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if compat.decode_allocation_policy(self) != "early":
            raise ValueError("pdsdk transfer backend: --disaggregation-decode-allocation-policy prefill_complete "
                             "is not supported; use early (the default)")
        self.kv_item_lens = [int(n) for n in args.kv_item_lens]
        self.aux_item_lens = [int(n) for n in getattr(args, "aux_item_lens", []) or []]
        spec = self.pdsdk_config.transport
        layout = layout_from_kv_args(args, tp_size=self.attn_tp_size, tp_rank=self.attn_tp_rank,
                                     is_mla=bool(is_mla_backend))
        device = kv_device(args)
        self.transport = open_transport(spec, layout=layout, host=self.local_ip,
                                        transfer_timeout_s=self.pdsdk_config.timeouts.transfer_s,
                                        connect_timeout_s=self.pdsdk_config.timeouts.connect_s)
        self.transport.register(kv_regions(args, device))
        log.info("pdsdk: %s KV manager, transport %s (%s), %d KV + %d aux buffers, layout %s",
                 disaggregation_mode.value, spec.name, self.transport.path(), len(self.kv_item_lens),
                 len(self.aux_item_lens), layout.fingerprint())
        self._push_lock = threading.Lock()
        # Anyone can reach the PULL socket: refused messages are counted and logged once a minute, and a
        # frame bigger than any registration or request (descriptors, page lists) drops its sender.
        self._refuse = Refusals(f"KV control socket of engine rank {self.kv_args.engine_rank}", log)
        self.server_socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.decode_peers: dict[str, _DecodePeer] = {}
            self._queue: queue.Queue = queue.Queue()
            self._progress: dict[int, _RoomProgress] = {}
            self._threads = [threading.Thread(target=self._guard(self._control_loop), name="pdsdk-control", daemon=True),
                             threading.Thread(target=self._guard(self._transfer_loop), name="pdsdk-transfer",
                                              daemon=True)]
        else:
            self._threads = [threading.Thread(target=self._guard(self._status_loop), name="pdsdk-status", daemon=True)]
        for t in self._threads:
            t.start()
        if disaggregation_mode == DisaggregationMode.DECODE:
            self._heartbeat = self._start_heartbeat_checker_thread()

    # --- both sides --------------------------------------------------------------------------

    def _guard(self, loop: Any) -> Any:
        def run() -> None:
            try:
                loop()
            except Exception:  # noqa: BLE001 - say which thread died; SGLang's timeouts then fail the rooms
                if not self._stop.is_set():
                    log.exception("pdsdk: %s thread died on engine rank %s", loop.__name__, self.kv_args.engine_rank)
        return run

    def _recv(self) -> list[bytes] | None:
        """One multipart message from our PULL socket, or None after 100 ms (to notice teardown)."""
        if not self.server_socket.poll(100):
            return None
        return self.server_socket.recv_multipart()

    def _push(self, ip: str, port: int, frames: list[bytes]) -> None:
        addr = compat.network_address(ip, port)
        sock = self._connect(addr.to_tcp(), is_ipv6=addr.is_ipv6)  # CommonKVManager caches PUSH sockets
        with self._push_lock:  # zmq sockets are not thread-safe
            sock.send_multipart(frames)

    def check_status(self, bootstrap_room: int) -> KVPoll:
        return self.request_status.get(bootstrap_room, KVPoll.Failed)

    def fail(self, room: int, reason: str) -> None:
        """Record the first reason and mark the room Failed."""
        with self.failure_lock:
            self.failure_records.setdefault(room, reason)
        self.update_status(room, KVPoll.Failed)

    def register_buffer_to_engine(self) -> None:
        """Buffers are registered with the transport at start (SGLang may call this again)."""

    def teardown(self) -> None:
        self._stop.set()
        if getattr(self, "_queue", None) is not None:
            self._queue.put(_STOP)
        if hasattr(self, "_heartbeat_shutdown"):
            self._heartbeat_shutdown.set()
        for t in self._threads:
            t.join(5)
        self.transport.close()

    # --- prefill: control thread ---------------------------------------------------------------

    def _control_loop(self) -> None:
        while not self._stop.is_set():
            frames = self._recv()
            if frames:
                self._guarded(self._on_control, frames)

    def _guarded(self, handler: Any, frames: list[bytes]) -> None:
        """Any peer can reach our PULL socket: what it sends may fail its handler, never the thread."""
        try:
            handler(frames)
        except Exception as e:  # noqa: BLE001 - foreign or corrupt traffic is refused, not fatal
            self._refuse(f"{type(e).__name__} handling a {frames[0][:16]!r} message")

    def _on_control(self, frames: list[bytes]) -> None:
        if frames[0] == wire.TAG:
            msg = wire.decode(frames)
            if isinstance(msg, wire.Registration):
                self._on_registration(msg)
            else:
                self._on_request(msg)
        elif frames[0] == wire.ABORT_TAG and len(frames) > 1:
            room = int(frames[1])
            if room in self.request_status and self.check_status(room) != KVPoll.Success:
                self.fail(room, "Aborted by decode-side abort notification.")
        else:
            self._refuse("an unknown message tag")

    def _on_registration(self, reg: wire.Registration) -> None:
        problem = None
        if reg.transport != self.transport.name:
            problem = (f"decode uses pdsdk transport {reg.transport!r}, this prefill {self.transport.name!r}; "
                       "set the same transport in PDSDK_CONFIG on both")
        elif reg.tp_size != self.attn_tp_size and not self.is_mla_backend:
            problem = (f"prefill attention TP={self.attn_tp_size}, decode TP={reg.tp_size}: the pdsdk backend moves "
                       "whole pages, so MHA models need the same TP on both sides")
        elif reg.page_size != self.kv_args.page_size:
            problem = f"page size: prefill {self.kv_args.page_size}, decode {reg.page_size}; use the same --page-size"
        elif reg.kv_item_lens != self.kv_item_lens:
            problem = (f"KV page bytes per buffer differ (prefill {self.kv_item_lens[:4]}..., decode "
                       f"{reg.kv_item_lens[:4]}...): same model, dtype and page size on both sides?")
        elif reg.aux_item_lens[:len(self.aux_item_lens)] != self.aux_item_lens[:len(reg.aux_item_lens)]:
            problem = f"metadata buffers differ (prefill {self.aux_item_lens}, decode {reg.aux_item_lens})"
        if problem:
            log.error("pdsdk: decode %s:%d cannot be served: %s", reg.ip, reg.port, problem)
        self.decode_peers[reg.agent] = _DecodePeer(reg, problem)

    def _on_request(self, req: wire.TransferRequest) -> None:
        room = req.room
        infos = self.transfer_infos.setdefault(room, {})
        infos[req.agent] = req
        if len(infos) == req.required_dst_info_num:
            self.req_to_decode_prefix_len[room] = req.decode_prefix_len
            self.update_status(room, KVPoll.WaitingForInput)

    # --- prefill: transfers --------------------------------------------------------------------

    def add_transfer_request(self, bootstrap_room: int, kv_indices: Any, index_slice: slice, is_last_chunk: bool,
                             aux_index: int | None = None, state_indices: Any = None, *_: Any, **__: Any) -> None:
        """Called by the sender for each chunk the scheduler finished; the transfer thread moves it."""
        if bootstrap_room not in self.transfer_infos:
            return  # dummy rank, or the room was cleared
        has_state = bool(state_indices) and any(s is not None and len(s) for s in state_indices)
        self._queue.put(_Chunk(bootstrap_room, np.asarray(kv_indices, dtype=np.int64), index_slice, is_last_chunk,
                               aux_index, has_state))

    def _transfer_loop(self) -> None:
        while True:
            chunk = self._queue.get()
            if chunk is _STOP:
                return
            room = chunk.room
            if room not in self.request_status or self.check_status(room) == KVPoll.Failed:
                self._progress.pop(room, None)
                continue
            infos = self.transfer_infos.get(room)
            if not infos:
                continue
            self.update_status(room, KVPoll.Transferring)
            progress = self._progress.setdefault(room, _RoomProgress())
            targets = [(r.ip, r.port) for r in infos.values() if not r.is_dummy]
            try:
                for req in list(infos.values()):
                    if not req.is_dummy:
                        progress.bytes += self._move(chunk, req)
            except Exception as e:  # noqa: BLE001 - a failed transfer fails the room, never the thread
                reason = str(e) if isinstance(e, _TransferFailed) else f"{type(e).__name__}: {e}"
                self.fail(room, f"pdsdk {self.transport.name}: {reason}")
                self._progress.pop(room, None)
                self._tell(targets, room, KVPoll.Failed, self.failure_records.get(room, reason))
                continue
            if chunk.is_last:
                self._progress.pop(room, None)
                if self.check_status(room) == KVPoll.Failed:  # aborted while the last chunk moved
                    self._tell(targets, room, KVPoll.Failed, self.failure_records.get(room))
                    continue
                self.update_status(room, KVPoll.Success)
                self._tell(targets, room, KVPoll.Success)

    def _move(self, chunk: _Chunk, req: wire.TransferRequest) -> int:
        """Write one chunk (and, on the last, the metadata row) into one decode rank; bytes moved."""
        if chunk.has_state:
            raise _TransferFailed("this request carries hybrid-model state (Mamba/SWA/DSA slots), which the pdsdk "
                                  "backend does not transfer yet; use mooncake or nixl for hybrid models")
        target = self.decode_peers.get(req.agent)
        if target is None:
            raise _TransferFailed(f"decode {req.ip}:{req.port} sent a request before registering its buffers")
        if target.problem:
            raise _TransferFailed(target.problem)
        dst = np.frombuffer(req.kv_indices, dtype=np.int32).astype(np.int64)[chunk.index_slice]
        src = chunk.pages
        if len(src) != len(dst):
            # "Should never happen" (page size > 1 rounding); SGLang's own backends keep the leading pages.
            log.warning("pdsdk: room %d: %d prefill pages for %d decode pages", chunk.room, len(src), len(dst))
            n = min(len(src), len(dst))
            src, dst = src[:n], dst[:n]
        aux = None
        if chunk.is_last and chunk.aux_index is not None and req.aux_index is not None:
            aux = (chunk.aux_index, req.aux_index)
        if not len(src) and aux is None:
            return 0
        aux_lens = self.aux_item_lens[:len(target.reg.aux_item_lens)]
        local, remote = transfer_spans(src, dst, self.kv_item_lens, aux, aux_lens)
        if target.peer is None:
            target.peer = self.transport.connect(target.reg.descriptor)
        # KV pages sit on the GPU, metadata rows in host memory: one transfer each, posted together
        # (a transfer moves one device's memory per side, Transport.read/write).
        is_kv = local[:, 0] < len(self.kv_item_lens)
        handles = [self.transport.write(target.peer, local[rows], remote[rows]) for rows in (is_kv, ~is_kv)
                   if rows.any()]
        statuses = [self.transport.wait(h) for h in handles]
        for h in handles:
            self.transport.release(h)
        bad = next((st for st in statuses if st.state != "done"), None)
        if bad is not None:
            raise _TransferFailed(f"write to decode {req.ip}:{req.port} failed: {bad.reason}")
        return int(local[:, 2].sum())

    def _tell(self, targets: list[tuple[str, int]], room: int, status: int, reason: str | None = None) -> None:
        frames = wire.encode_status(wire.TransferStatus(room=room, status=int(status), rank=self._rank(),
                                                        reason=reason))
        for ip, port in targets:
            try:
                self._push(ip, port, frames)
            except zmq.ZMQError as e:
                log.warning("pdsdk: could not tell decode %s:%d room %d's status: %s", ip, port, room, e)

    def _rank(self) -> int:
        return self.attn_tp_rank * (self.pp_size * self.attn_cp_size) + self.pp_rank * self.attn_cp_size + \
            self.attn_cp_rank

    # --- decode --------------------------------------------------------------------------------

    def registration(self) -> list[bytes]:
        return wire.encode(wire.Registration(
            agent=self.transport.agent, ip=self.local_ip, port=self.rank_port, descriptor=self.transport.descriptor(),
            transport=self.transport.name, tp_size=self.attn_tp_size, tp_rank=self.attn_tp_rank,
            page_size=int(self.kv_args.page_size), kv_item_lens=self.kv_item_lens, aux_item_lens=self.aux_item_lens))

    def _status_loop(self) -> None:
        while not self._stop.is_set():
            frames = self._recv()
            if not frames:
                continue
            if frames[0] != wire.STATUS_TAG:
                log.debug("pdsdk: decode ignores control message tag %r", frames[0][:20])
                continue
            self._guarded(lambda f: self._on_status(wire.decode_status(f)), frames)

    def _on_status(self, st: wire.TransferStatus) -> None:
        room = st.room
        if room not in self.request_status:
            return  # cleared already: a late status must not leak into a reused room
        if st.status == KVPoll.Failed:
            self.fail(room, st.reason or self.DEFAULT_FAILURE)
            return
        if st.status == KVPoll.Success:
            done = self.prefill_response_tracker.setdefault(room, set())
            done.add(st.rank)
            if len(done) >= self.required_prefill_response_num_table.get(room, 1):
                self.update_status(room, KVPoll.Success)

    DEFAULT_FAILURE = "the prefill instance reported a failed KV transfer without a reason"


class _TransferFailed(RuntimeError):
    """A transfer failed for a reason worth showing as is."""


def kv_device(args: Any) -> str:
    """Where the KV buffers live: the scheduler's GPU, or host memory (CPU engines, tests)."""
    gpu = getattr(args, "gpu_id", None)
    if gpu is None:
        return "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            return f"cuda:{int(gpu)}"
    except Exception:  # noqa: BLE001 - no usable CUDA: host memory
        pass
    return "cpu"
