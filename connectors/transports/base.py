"""The L2 transport contract (docs/transports.md), and what every transport shares.

One-sided and page-oriented: a side registers memory regions, hands its `descriptor()` to the
peer out of band, the peer `connect`s and posts `read`/`write` of span lists, then `poll`s. The
base class validates spans, coalesces them, enforces deadlines and reports to the observation
hooks; a transport implements only the `_`-prefixed backend methods.

Failure is a state, never a hang: every transfer has a deadline, and a dead peer shows up as
`TransferStatus("failed", reason)` by then at the latest.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from pdsdk.connectors.transports.common.descriptor import Descriptor, Peer
from pdsdk.connectors.transports.common.path_judge import PathJudge
from pdsdk.connectors.transports.common.staging import StagedTransfer
from pdsdk.connectors.transports.common.status import DONE, STATUS_PENDING, TransferStatus, failed
from pdsdk.errors import ConfigError, TransportError
from pdsdk.kv import KVLayout, Region, Span, check_pages, check_spans, coalesce
from pdsdk.plugins import notify as notify_observers

log = logging.getLogger(__name__)

Spans = Sequence[Span] | np.ndarray
_live: weakref.WeakSet = weakref.WeakSet()  # transports not closed yet


@atexit.register
def _close_all() -> None:
    """Close what the process left open before the interpreter finalizes: native threads (UCX/NIXL
    progress, Mooncake, gloo waits) still running while C++ statics are destroyed abort the
    process ("terminate called without an active exception") after its work is done."""
    for transport in list(_live):
        try:
            transport.close()
        except Exception:  # noqa: BLE001 - exiting anyway; a half-built transport may not close
            pass


@dataclass
class _Transfer:
    op: str
    peer: Peer
    nbytes: int
    started: float
    deadline: float
    backend: Any
    spans: int = 1
    status: TransferStatus = STATUS_PENDING


@dataclass
class TransportStats:
    transfers: int = 0
    failed: int = 0
    bytes: int = 0
    seconds: float = 0.0
    by_reason: dict[str, int] = field(default_factory=dict)


class Transport(ABC):
    """Base of every transport. Subclasses set OPTIONS and implement the backend methods."""

    # Options a config may pass (name -> default); anything else is a ConfigError naming the choices.
    OPTIONS: dict[str, Any] = {}
    # One-sided transports whose per-descriptor cost makes the staged path worth it (common/staging.py).
    SUPPORTS_STAGING = False
    STAGING_OPTIONS = {
        "staging": "auto",  # auto: by the cost rule; on: always for scattered spans; off: never
        "staging_bytes": None,  # staging buffer size; default 256 MiB when regions are on GPU, else none
    }
    # Peers are transports of this same process (`fake`): test drivers keep the other side in this process.
    IN_PROCESS = False

    def __init__(self, *, name: str, layout: KVLayout, agent: str | None = None,
                 transfer_timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
                 host: str = "127.0.0.1", **options: Any):
        valid = {**self.OPTIONS, **(self.STAGING_OPTIONS if self.SUPPORTS_STAGING else {})}
        unknown = set(options) - set(valid)
        if unknown:
            raise ConfigError(f"transport.options.{sorted(unknown)[0]}",
                              f"unknown option for transport {name!r}; valid: {', '.join(sorted(valid)) or 'none'}")
        if options.get("staging", "auto") not in ("auto", "on", "off"):
            raise ConfigError("transport.options.staging", f"got {options['staging']!r}; valid: auto, on, off")
        self.name = name
        self.layout = layout
        self.agent = agent or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.host = host
        self.transfer_timeout_s = transfer_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.options = {**valid, **options}
        self.regions: list[Region] = []
        self._stager: Any = None
        self._path_warning: str | None = None
        self._path_judge = PathJudge()
        self._transfers: dict[int, _Transfer] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stats = TransportStats()
        self._closed = False
        _live.add(self)

    # --- the contract ---------------------------------------------------------------------------

    def register(self, regions: Sequence[Region]) -> None:
        """Make regions readable/writable by peers. Spans name regions by their index, in
        registration order (a later call appends). Register before sending `descriptor()`."""
        self._check_open()
        for i, r in enumerate(regions):
            if r.length <= 0 or r.addr <= 0:
                raise ValueError(f"region {len(self.regions) + i}: address {r.addr:#x} and length {r.length} "
                                 "must both be positive")
        self._register(list(regions))
        self.regions.extend(regions)
        self._setup_staging()

    @property
    def all_regions(self) -> list[Region]:
        """Registered regions plus the staging buffer (last), for address lookups in backends."""
        return self.regions + ([self._stager.buffer.region] if self._stager else [])

    def _setup_staging(self) -> None:
        if not self.SUPPORTS_STAGING or self._stager is not None or self.options["staging"] == "off":
            return
        device = next((r.device for r in self.regions if r.device != "cpu"), "cpu")
        nbytes = self.options["staging_bytes"]
        if nbytes is None:
            nbytes = 256 << 20 if device != "cpu" or self.options["staging"] == "on" else 0
        if nbytes:
            from pdsdk.connectors.transports.common.staging import Stager

            self._stager = Stager(self, int(nbytes), device)
            self._register([self._stager.buffer.region])

    def descriptor(self) -> bytes:
        """Handshake material for the peer: agent, regions, layout fingerprint, backend metadata."""
        self._check_open()
        return msgspec.msgpack.encode(Descriptor(
            transport=self.name, agent=self.agent, host=self.host, layout=self.layout,
            regions=self.regions, meta={**self._metadata(), **(self._stager.metadata() if self._stager else {})}))

    def connect(self, peer_descriptor: bytes) -> Peer:
        """Connect to a peer; fails here, naming the field, when the KV layouts differ."""
        self._check_open()
        try:
            d = msgspec.msgpack.decode(peer_descriptor, type=Descriptor)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise TransportError(f"{self.name}: peer descriptor is not a pdsdk descriptor ({e})") from None
        if d.transport != self.name:
            raise TransportError(f"peer {d.agent} uses transport {d.transport!r}, this side {self.name!r}; "
                                 "configure both sides with the same transport")
        self.layout.check_compatible(d.layout)
        peer = Peer(agent=d.agent, host=d.host, regions=list(d.regions), layout=d.layout, backend_meta=dict(d.meta))
        peer.backend = self._connect(d, peer)
        return peer

    def read(self, peer: Peer, local: Spans, remote: Spans, notify: bytes | None = None) -> int:
        """Copy the peer's `remote` spans into our `local` spans. Returns a handle for `poll`.
        Spans are lists of `Span` or (n, 3) int arrays (region, offset, length), paired by position;
        each side's spans lie in one device's memory (host, or one GPU): post one call per device.
        `notify`, if given, is delivered to the peer's `notifications()` once the bytes are moved."""
        return self._start("READ", peer, local, remote, notify)

    def write(self, peer: Peer, local: Spans, remote: Spans, notify: bytes | None = None) -> int:
        """Copy our `local` spans into the peer's `remote` spans; as `read` otherwise."""
        return self._start("WRITE", peer, local, remote, notify)

    def read_pages(self, peer: Peer, local_region: int, local_pages: Any, remote_region: int, remote_pages: Any,
                   notify: bytes | None = None) -> int:
        """Page-oriented `read`: copy the peer's pages `remote_pages` of `remote_region` into our pages
        `local_pages` of `local_region` (page = `layout.page_bytes`; ids are int arrays, paired by
        position). Same contract as `read`; transports with a page-native path (one GPU gather
        kernel) skip span bookkeeping entirely, which is what keeps a 4608-page transfer sub-ms."""
        return self._start_pages("READ", peer, local_region, local_pages, remote_region, remote_pages, notify)

    def write_pages(self, peer: Peer, local_region: int, local_pages: Any, remote_region: int, remote_pages: Any,
                    notify: bytes | None = None) -> int:
        """Page-oriented `write`; see `read_pages`."""
        return self._start_pages("WRITE", peer, local_region, local_pages, remote_region, remote_pages, notify)

    def poll(self, handle: int) -> TransferStatus:
        """pending, done, or failed(reason). Never blocks; a transfer past its deadline is failed."""
        with self._lock:
            t = self._transfers.get(handle)
        if t is None:
            raise TransportError(f"{self.name}: unknown transfer handle {handle}")
        if t.status.final:
            return t.status
        try:
            status = self._stager.poll(t.backend) if self._is_staged(t.backend) else self._poll(t.backend)
        except Exception as e:  # noqa: BLE001 - a backend error is a failed transfer, not a crash
            status = failed(f"{type(e).__name__}: {e}")
        if not status.final and time.monotonic() > t.deadline:
            status = failed(f"deadline of {self.transfer_timeout_s:g}s passed ({t.op} of {t.nbytes} bytes "
                            f"with {t.peer.agent})")
        if status.final:
            self._finish(handle, t, status)
        return status

    def wait(self, handle: int, timeout: float | None = None) -> TransferStatus:
        """Poll until final or until `timeout` seconds pass (then still pending). Yields for the
        first millisecond (GPU transfers finish in tens of microseconds), then backs off to 1 ms."""
        start = time.monotonic()
        end = None if timeout is None else start + timeout
        sleep = 2e-5
        while True:
            status = self.poll(handle)
            now = time.monotonic()
            if status.final or (end is not None and now > end):
                return status
            if now - start < 1e-3:
                time.sleep(0)
            else:
                time.sleep(sleep)
                sleep = min(0.001, sleep * 2)

    def release(self, handle: int) -> None:
        """Forget a finished transfer (poll keeps the final status until then)."""
        with self._lock:
            t = self._transfers.get(handle)
            if t is not None and t.status.final:
                del self._transfers[handle]

    def notifications(self) -> list[tuple[str, bytes]]:
        """(peer agent, message) for every notify delivered to this side since the last call."""
        self._check_open()
        return self._notifications() + (self._stager.take_notes() if self._stager else [])

    def stats(self) -> dict[str, Any]:
        """Counters, and `path`: what actually carries the bytes (and any warning about it)."""
        s = self._stats
        return {"transport": self.name, "agent": self.agent, "path": self.path(), "transfers": s.transfers,
                "failed": s.failed, "bytes": s.bytes, "seconds": round(s.seconds, 6),
                "gbps": round(s.bytes / s.seconds / 1e9, 3) if s.seconds else None,
                "failures": dict(s.by_reason), "path_warning": self._path_warning, **self._extra_stats()}

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Fail what is pending, release registered memory and connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        with self._lock:
            pending = [(h, t) for h, t in self._transfers.items() if not t.status.final]
        for h, t in pending:
            self._finish(h, t, failed("transport closed"))
        try:
            if self._stager is not None:
                self._stager.close()
            self._close()
        except Exception:  # noqa: BLE001
            log.exception("%s: error while closing", self.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- backend hooks --------------------------------------------------------------------------

    def path(self) -> str:
        """What carries the bytes, e.g. "ucx(tls=auto) VRAM", with a loud WARNING when a fast path was
        expected and a slow one was taken."""
        return self._path() + (f" WARNING: {self._path_warning}" if self._path_warning else "")

    @abstractmethod
    def _path(self) -> str: ...

    # Whether GPU memory can silently take a host path (UCX over TCP, NCCL over sockets): then a
    # slow large VRAM->VRAM transfer is reported as one. `local` has no such path: CUDA IPC or fail.
    MAY_TAKE_HOST_PATH = True

    def _slow_path_hint(self) -> str:
        """What to do when GPU memory moved through the host (transport-specific)."""
        return "between processes on one GPU use transport 'local' (CUDA IPC)"

    @abstractmethod
    def _register(self, regions: list[Region]) -> None: ...

    def _metadata(self) -> dict[str, Any]:
        return {}

    @abstractmethod
    def _connect(self, d: Descriptor, peer: Peer) -> Any: ...

    @abstractmethod
    def _post(self, op: str, peer: Peer, local: np.ndarray, remote: np.ndarray, notify: bytes | None) -> Any:
        """Start moving coalesced spans ((n, 3) arrays, see pdsdk.kv); return a handle for `_poll`."""

    def _post_pages(self, op: str, peer: Peer, local_region: int, local_pages: np.ndarray, remote_region: int,
                    remote_pages: np.ndarray, notify: bytes | None) -> Any:
        """Optional page-native path (validated ids); the default goes through spans."""
        raise NotImplementedError

    @abstractmethod
    def _poll(self, backend: Any) -> TransferStatus: ...

    def _release(self, backend: Any, status: TransferStatus) -> None:
        """Free backend resources of a finished (or abandoned) transfer."""

    @abstractmethod
    def _notifications(self) -> list[tuple[str, bytes]]: ...

    def _extra_stats(self) -> dict[str, Any]:
        return {}

    @abstractmethod
    def _close(self) -> None: ...

    # --- shared machinery -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self.name} ({self.agent}) is closed")

    def _start(self, op: str, peer: Peer, local: Spans, remote: Spans,
               notify: bytes | None) -> int:
        self._check_open()
        local, remote = coalesce(check_spans(local, self.regions, "local"),
                                 check_spans(remote, peer.regions, "remote"))
        if not len(local):
            raise ValueError("nothing to transfer: no spans given")
        nbytes = int(local[:, 2].sum())

        def post() -> Any:
            if self._use_staging(peer, local, nbytes):
                return self._stager.start(op, peer, local, remote, notify)
            return self._post(op, peer, local, remote, notify)

        return self._launch(op, peer, nbytes, len(local), post)

    def _start_pages(self, op: str, peer: Peer, local_region: int, local_pages: Any, remote_region: int,
                     remote_pages: Any, notify: bytes | None) -> int:
        self._check_open()
        pb = self.layout.page_bytes
        lp = check_pages(local_pages, self.regions, local_region, pb, "local")
        rp = check_pages(remote_pages, peer.regions, remote_region, pb, "remote")
        if len(lp) != len(rp) or not len(lp):
            raise ValueError(f"{len(lp)} local pages but {len(rp)} remote pages; give the same number, at least one")
        if type(self)._post_pages is Transport._post_pages:
            from pdsdk.kv import page_spans

            return self._start(op, peer, page_spans(local_region, lp, pb), page_spans(remote_region, rp, pb), notify)
        return self._launch(op, peer, len(lp) * pb, len(lp),
                            lambda: self._post_pages(op, peer, local_region, lp, remote_region, rp, notify))

    def _launch(self, op: str, peer: Peer, nbytes: int, nspans: int, post: Any) -> int:
        """Bookkeeping shared by every way of starting a transfer: handle, deadline, hooks."""
        handle = next(self._ids)
        now = time.monotonic()
        try:
            backend = post()
            status = STATUS_PENDING
        except Exception as e:  # noqa: BLE001 - a peer that is gone fails the transfer, it does not raise
            backend, status = None, failed(f"{type(e).__name__}: {e}")
        t = _Transfer(op, peer, nbytes, now, now + self.transfer_timeout_s, backend, nspans)
        with self._lock:
            self._transfers[handle] = t
        notify_observers("pdsdk_transfer_started", transport=self.name, transfer_id=f"{self.agent}/{handle}",
                         peer=peer.agent, nbytes=nbytes, spans=nspans)
        if status.final:
            self._finish(handle, t, status)
        return handle

    def _use_staging(self, peer: Peer, local: np.ndarray, nbytes: int) -> bool:
        if self._stager is None or "staging" not in peer.backend_meta or len(local) < 2:
            return False
        if self.options["staging"] == "on":
            return True
        from pdsdk.connectors.transports.common.staging import prefer_staged

        return prefer_staged(len(local), nbytes, self._stager.buffer.device)

    def _is_staged(self, backend: Any) -> bool:
        return isinstance(backend, StagedTransfer)

    def _finish(self, handle: int, t: _Transfer, status: TransferStatus) -> None:
        with self._lock:
            if t.status.final:
                return
            t.status = status
        seconds = time.monotonic() - t.started
        try:
            if self._is_staged(t.backend):
                self._stager.release(t.backend)
            else:
                self._release(t.backend, status)
        except Exception:  # noqa: BLE001
            log.debug("%s: release failed", self.name, exc_info=True)
        tid = f"{self.agent}/{handle}"
        if status.state == DONE:
            self._stats.transfers += 1
            self._stats.bytes += t.nbytes
            self._stats.seconds += seconds
            notify_observers("pdsdk_transfer_finished", transport=self.name, transfer_id=tid, peer=t.peer.agent,
                             nbytes=t.nbytes, seconds=seconds, path=self.path())
            self._observe_rate(t, seconds)
        else:
            self._stats.failed += 1
            key = (status.reason or "?").split(" (")[0][:80]
            self._stats.by_reason[key] = self._stats.by_reason.get(key, 0) + 1
            log.warning("%s: %s with %s failed: %s", self.name, t.op, t.peer.agent, status.reason)
            notify_observers("pdsdk_transfer_failed", transport=self.name, transfer_id=tid, peer=t.peer.agent,
                             reason=status.reason)

    def _observe_rate(self, t: _Transfer, seconds: float) -> None:
        """A host path under GPU memory is said once, loudly, in the log and in path() (common/path_judge.py)."""
        if not self.MAY_TAKE_HOST_PATH or self._path_warning is not None:
            return
        if any(r.device == "cpu" for r in itertools.chain(self.regions, t.peer.regions)):
            return
        gbps = self._path_judge.host_path_rate(t.peer.agent, t.nbytes, t.spans, seconds)
        if gbps is not None:
            self._path_warning = (f"VRAM->VRAM ran at {gbps:.2f} GB/s at best: the bytes went through the host, "
                                  f"not NVLink/PCIe P2P; {self._slow_path_hint()}")
            log.warning("%s: %s", self.name, self._path_warning)
