"""The staged path for scattered pages: gather into a contiguous staging buffer, move it with one
transfer, scatter on the other side.

One descriptor per small page costs two orders of magnitude on GPUs (NIXL 3.7 GB/s per 32 KiB page
against 250+ GB/s for one descriptor, on two H200s), while one gather kernel moves the
same pages at HBM speed. On CPU a numpy gather costs more than the per-descriptor overhead it
saves, so the cost rule (`prefer_staged`) keeps the direct path there; `pdsdk bench transport
--staging on|off` measures both.

Protocol, over the transport's control channel (msgpack), for a READ of remote spans R into local
spans L: local -> remote "gather"(R); remote gathers into its staging buffer and answers with the
offset; local reads that contiguous range into its own staging buffer, scatters it into L, and
tells the remote to "release" its area. A WRITE mirrors it: local gathers, asks the remote to
"alloc", writes, and asks it to "scatter". Each side frees what it allocated; nothing waits forever.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdsdk.connectors.transports.common.buffers import allocate, cuda_index, host_array, torch_view
from pdsdk.connectors.transports.common.packing import pack_spans
from pdsdk.kv import Region

# The cost rule's constants, from the transport measurements in docs/benchmarks.md.
PER_RUN_S = 9e-6  # one descriptor of a small page: NIXL 40 ms / 4608 pages on GPU, ~10 us on CPU
GATHER_GBPS = {"cpu": 5.0, "cuda": 1500.0}  # numpy gather on host; one index kernel on HBM
ROUND_TRIP_S = 300e-6  # the extra control messages


def prefer_staged(runs: int, nbytes: int, device: str) -> bool:
    """True when gathering + scattering beats sending each run as its own descriptor."""
    kind = "cpu" if cuda_index(device) is None else "cuda"
    staged = 2 * nbytes / (GATHER_GBPS[kind] * 1e9) + ROUND_TRIP_S
    return runs > 1 and staged < runs * PER_RUN_S


class StagingBuffer:
    """A registered buffer handed out in contiguous areas (first fit; areas are short-lived)."""

    def __init__(self, nbytes: int, device: str):
        self.owner, self.region = allocate(nbytes, device)
        self.device = device
        self._free = [(0, nbytes)]  # sorted (offset, length)
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= nbytes:
                    self._free[i:i + 1] = [(off + nbytes, length - nbytes)] if length > nbytes else []
                    return off
        return None

    def free(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._free.append((offset, nbytes))
            self._free.sort()
            merged = [self._free[0]]
            for off, length in self._free[1:]:
                last_off, last_len = merged[-1]
                if last_off + last_len == off:
                    merged[-1] = (last_off, last_len + length)
                else:
                    merged.append((off, length))
            self._free = merged


def _view(region: Region, offset: int, nbytes: int) -> Any:
    if cuda_index(region.device) is None:
        return host_array(region.addr + offset, nbytes)
    return torch_view(region.addr + offset, nbytes, region.device)


def gather(regions: list[Region], spans: np.ndarray, staging: StagingBuffer, offset: int) -> None:
    """Copy spans, in order, into staging[offset:]; one index kernel/numpy take per region."""
    _move(regions, spans, staging, offset, into_staging=True)


def scatter(regions: list[Region], spans: np.ndarray, staging: StagingBuffer, offset: int) -> None:
    """Copy staging[offset:] out to spans, in order."""
    _move(regions, spans, staging, offset, into_staging=False)


def _move(regions: list[Region], spans: np.ndarray, staging: StagingBuffer, offset: int, into_staging: bool) -> None:
    total = int(spans[:, 2].sum())
    views = {int(r): _view(regions[int(r)], 0, regions[int(r)].length) for r in np.unique(spans[:, 0])}
    pack_spans(views, spans, _view(staging.region, offset, total), unpack=not into_staging)
    if cuda_index(staging.device) is not None:
        import torch

        torch.cuda.current_stream(staging.region.device).synchronize()


@dataclass
class StagedTransfer:
    """Where a staged transfer is: waiting for the peer, moving, or finishing."""

    op: str
    peer: Any
    local: np.ndarray
    remote: np.ndarray
    notify: bytes | None
    nbytes: int
    local_offset: int
    stage: str = "waiting"  # waiting -> moving -> done | failed
    remote_offset: int | None = None
    inner: Any = None  # the backend handle of the contiguous transfer
    error: str | None = None
    event: threading.Event = field(default_factory=threading.Event)


class Stager:
    """Runs staged transfers for a one-sided transport; owns its staging buffer and control channel."""

    def __init__(self, transport: Any, nbytes: int, device: str):
        from concurrent.futures import ThreadPoolExecutor

        from pdsdk.connectors.transports.common.control import ControlChannel

        self.t = transport
        self.buffer = StagingBuffer(nbytes, device)
        self.control = ControlChannel(transport.agent, transport.host, self._on_message)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"pdsdk-stage-{transport.agent}")
        self._waiting: dict[str, StagedTransfer] = {}
        self._ids = iter(range(1, 1 << 62))
        self.notes: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()

    def metadata(self) -> dict[str, Any]:
        return {"staging": [self.buffer.region.addr, self.buffer.region.length, self.buffer.region.device],
                "control": self.control.address}

    def start(self, op: str, peer: Any, local: np.ndarray, remote: np.ndarray, notify: bytes | None) -> StagedTransfer:
        nbytes = int(local[:, 2].sum())
        offset = self.buffer.alloc(nbytes)
        if offset is None:
            raise MemoryError(f"staging buffer ({self.buffer.region.length} bytes) has no room for {nbytes} bytes; "
                              "raise transport option staging_bytes")
        st = StagedTransfer(op, peer, local, remote, notify, nbytes, offset)
        tid = f"{self.t.agent}/{next(self._ids)}"
        with self._lock:
            self._waiting[tid] = st
        st.id = tid
        address = peer.backend_meta["control"]
        if op == "READ":
            self.control.send(address, {"op": "gather", "id": tid, "spans": remote.tolist(), "reply": self.control.address})
        else:
            self._pool.submit(self._gather_then_alloc, st, address)
        return st

    def _gather_then_alloc(self, st: StagedTransfer, address: str) -> None:
        try:
            gather(self.t.regions, st.local, self.buffer, st.local_offset)
        except Exception as e:  # noqa: BLE001
            st.error, st.stage = f"gather failed: {e}", "failed"
            return
        self.control.send(address, {"op": "alloc", "id": st.id, "nbytes": st.nbytes, "reply": self.control.address})

    def poll(self, st: StagedTransfer) -> Any:
        """The transport's Status for a staged transfer; never blocks."""
        from pdsdk.connectors.transports.common.status import STATUS_DONE, STATUS_PENDING, failed

        if st.stage == "failed":
            return failed(st.error or "staged transfer failed")
        if st.stage == "ready":  # the peer answered: move the contiguous range
            peer_stage = len(st.peer.regions)
            contiguous = np.array([[len(self.t.regions), st.local_offset, st.nbytes]], dtype=np.int64)
            remote = np.array([[peer_stage, st.remote_offset, st.nbytes]], dtype=np.int64)
            st.inner = self.t._post(st.op, st.peer, contiguous, remote, None)
            st.stage = "moving"
        if st.stage == "moving":
            status = self.t._poll(st.inner)
            if not status.final:
                return STATUS_PENDING
            if status.state != "done":
                return status
            st.stage = "finishing"
            self._pool.submit(self._finish, st)
        if st.stage == "finished":
            return STATUS_DONE
        return STATUS_PENDING

    def _finish(self, st: StagedTransfer) -> None:
        address = st.peer.backend_meta["control"]
        if st.op == "READ":
            try:
                scatter(self.t.regions, st.local, self.buffer, st.local_offset)
            except Exception as e:  # noqa: BLE001
                st.error, st.stage = f"scatter failed: {e}", "failed"
                return
            self.control.send(address, {"op": "release", "offset": st.remote_offset, "nbytes": st.nbytes,
                                        "notify": st.notify})
            st.stage = "finished"
        else:
            self.control.send(address, {"op": "scatter", "id": st.id, "offset": st.remote_offset,
                                        "spans": st.remote.tolist(), "notify": st.notify,
                                        "reply": self.control.address})

    def release(self, st: StagedTransfer) -> None:
        with self._lock:
            self._waiting.pop(getattr(st, "id", None), None)
        if st.inner is not None:
            self.t._release(st.inner, None)
        self.buffer.free(st.local_offset, st.nbytes)

    # --- the other side --------------------------------------------------------------------------

    def _on_message(self, sender: str, m: dict[str, Any]) -> None:
        op = m.get("op")
        if op in ("gather", "scatter"):
            self._pool.submit(self._serve, sender, m)
        elif op == "alloc":
            offset = self.buffer.alloc(m["nbytes"])
            reply = {"op": "ready", "id": m["id"], "offset": offset}
            if offset is None:
                reply["error"] = f"peer staging buffer has no room for {m['nbytes']} bytes"
            self.control.send(m["reply"], reply)
        elif op == "release":
            self.buffer.free(m["offset"], m["nbytes"])
            if m.get("notify") is not None:
                self.notes.append((sender, m["notify"]))
        elif op in ("ready", "scattered"):
            with self._lock:
                st = self._waiting.get(m["id"])
            if st is None:
                return
            if m.get("error"):
                st.error, st.stage = m["error"], "failed"
            elif op == "ready":
                st.remote_offset, st.stage = m["offset"], "ready"
            else:
                st.stage = "finished"

    def _serve(self, sender: str, m: dict[str, Any]) -> None:
        spans = np.asarray(m["spans"], dtype=np.int64).reshape(-1, 3)
        nbytes = int(spans[:, 2].sum())
        try:
            if m["op"] == "gather":
                offset = self.buffer.alloc(nbytes)
                if offset is None:
                    raise MemoryError(f"peer staging buffer has no room for {nbytes} bytes")
                gather(self.t.regions, spans, self.buffer, offset)
                self.control.send(m["reply"], {"op": "ready", "id": m["id"], "offset": offset})
            else:
                scatter(self.t.regions, spans, self.buffer, m["offset"])
                self.buffer.free(m["offset"], nbytes)
                if m.get("notify") is not None:
                    self.notes.append((sender, m["notify"]))
                self.control.send(m["reply"], {"op": "scattered", "id": m["id"]})
        except Exception as e:  # noqa: BLE001 - the initiator gets the reason, not a hang
            self.control.send(m["reply"], {"op": "ready" if m["op"] == "gather" else "scattered",
                                           "id": m["id"], "error": f"{type(e).__name__}: {e}"})

    def take_notes(self) -> list[tuple[str, bytes]]:
        with self._lock:
            notes, self.notes = self.notes, []
        return notes

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.control.close()
