"""`mooncake`: Mooncake Transfer Engine, peer-to-peer handshake (no etcd), tcp by default.

The engine's batch calls block with the GIL released, so each transfer runs on a small thread
pool and `poll` only looks at its future. Notifications ride on the engine's own notify
mechanism, attached to a one-byte repeat of the transfer's first span (idempotent).

On a machine without RDMA NICs the engine silently uses TCP whatever protocol was asked for
(Mooncake TE 0.3.13-0.3.14); the path report reads the engine's topology and says so loudly.
"""

from __future__ import annotations

import base64
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

from pdsdk.connectors.transports.base import Transport
from pdsdk.connectors.transports.common.descriptor import Descriptor, Peer
from pdsdk.connectors.transports.common.status import STATUS_DONE, STATUS_PENDING, TransferStatus, failed
from pdsdk.errors import TransportError
from pdsdk.kv import Region, span_addresses

log = logging.getLogger(__name__)
# nvlink: multi-node NVLink (wheels built with USE_MNNVL); nvlink_intra: GPUs of one host (USE_INTRA_NVLINK).
PROTOCOLS = ("tcp", "rdma", "nvlink", "nvlink_intra")
# A batch of more than ~2000 entries fails with -1 and breaks the session for good (0.3.13.post1).
MAX_BATCH = 1024


class MooncakeTransport(Transport):
    OPTIONS = {"protocol": "tcp", "device_name": "", "threads": 2}
    SUPPORTS_STAGING = True

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        protocol = self.options["protocol"]
        if protocol not in PROTOCOLS:
            from pdsdk.errors import ConfigError

            raise ConfigError("transport.options.protocol", f"unknown protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}")
        self._engine = TransferEngine()
        rc = self._engine.initialize(self.host, "P2PHANDSHAKE", protocol, self.options["device_name"])
        if rc != 0:
            raise TransportError(f"mooncake: TransferEngine.initialize({self.host!r}, P2PHANDSHAKE, {protocol!r}) "
                                 f"returned {rc}")
        self._pool = ThreadPoolExecutor(int(self.options["threads"]), thread_name_prefix=f"pdsdk-mooncake-{self.agent}")
        self._protocol, self._path_warning = self._detect_path(protocol)
        if self._path_warning:
            log.warning("mooncake: %s", self._path_warning)

    def _detect_path(self, asked: str) -> tuple[str, str | None]:
        try:
            topology = json.loads(self._engine.get_local_topology())
            hcas = any(any(lists) for lists in topology.values())
        except (ValueError, TypeError, AttributeError):
            hcas = False
        if asked == "tcp":
            return "tcp", None
        if asked == "rdma" and hcas:
            return "rdma", None
        if asked in ("nvlink", "nvlink_intra"):  # initialize() fails when the wheel lacks them
            return asked, None
        return "tcp", f"protocol {asked!r} was asked for but the engine found no RDMA device: it moves bytes over TCP"

    def _path(self) -> str:
        return self._protocol

    def _slow_path_hint(self) -> str:
        return ("ask protocol 'nvlink_intra' (GPUs of one host) or 'rdma', or use transport 'local' between "
                "processes of one host")

    def _register(self, regions: list[Region]) -> None:
        for r in regions:
            rc = self._engine.register_memory(r.addr, r.length)
            if rc != 0:
                raise TransportError(f"mooncake: register_memory({r.addr:#x}, {r.length}) returned {rc}")

    def _metadata(self) -> dict[str, Any]:
        return {"session": f"{self.host}:{self._engine.get_rpc_port()}"}

    def _connect(self, d: Descriptor, peer: Peer) -> Any:
        return d.meta["session"]  # the engine connects on first transfer

    def _post(self, op: str, peer: Peer, local: np.ndarray, remote: np.ndarray, notify: bytes | None) -> Future:
        # One engine call per transfer: splitting one over threads is slower (the peer's TCP
        # side needs the same cores); concurrent transfers do run on the pool side by side.
        return self._pool.submit(self._run, op, peer.backend, span_addresses(local, self.all_regions).tolist(),
                                 span_addresses(remote, peer.all_regions).tolist(), local[:, 2].tolist(), notify)

    def _run(self, op: str, session: str, laddr: list[int], raddr: list[int], lengths: list[int],
             notify: bytes | None) -> None:
        opcode = TransferOpcode.Read if op == "READ" else TransferOpcode.Write
        for i in range(0, len(lengths), MAX_BATCH):
            batch = slice(i, i + MAX_BATCH)
            rc = self._engine.batch_transfer_sync(session, laddr[batch], raddr[batch], lengths[batch], opcode)
            if rc != 0:
                raise ConnectionError(f"mooncake {op} with {session} returned {rc}")
        if notify is not None:
            note = TransferNotify(self.agent, base64.b64encode(notify).decode())
            rc = self._engine.transfer_sync(session, laddr[0], raddr[0], 1, opcode, note)
            if rc != 0:
                raise ConnectionError(f"mooncake notify to {session} returned {rc}")

    def _poll(self, backend: Future) -> TransferStatus:
        if not backend.done():
            return STATUS_PENDING
        e = backend.exception()
        return failed(f"{type(e).__name__}: {e}") if e else STATUS_DONE

    def _notifications(self) -> list[tuple[str, bytes]]:
        return [(n.name, base64.b64decode(n.msg)) for n in self._engine.get_notifies()]

    def _close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)  # a call blocked on a dead peer must not hold us
        for r in self.all_regions:
            self._engine.unregister_memory(r.addr)
