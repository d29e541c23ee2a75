"""`nixl`: NVIDIA NIXL with its UCX backend; DRAM and VRAM regions.

Page-aligned span lists go through prepared descriptor lists (prepared once per side, then a
transfer is two numpy index arrays); anything else through descriptors built per transfer.
NIXL's progress thread stays on, so a passive peer never stalls its initiator.

UCX facts this file acts on (NIXL 1.5.1's bundled UCX): the bundled libnl crashes every process at
exit when UCX's `ib` module loaded, so with no InfiniBand device present it is left out; UCX_TLS
must keep `tcp` (shm alone fails at agent creation); a VRAM transfer that UCX routes through the
host runs at ~0.5 GB/s instead of hundreds, so the achieved rate is checked and a slow path is
reported loudly.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from pdsdk.connectors.transports.base import Transport
from pdsdk.connectors.transports.common.buffers import cuda_index
from pdsdk.connectors.transports.common.descriptor import Descriptor, Peer
from pdsdk.connectors.transports.common.status import STATUS_DONE, STATUS_PENDING, TransferStatus, failed
from pdsdk.kv import Region, span_addresses

log = logging.getLogger(__name__)


def _prepare_env() -> None:
    ib = Path("/sys/class/infiniband")
    if not (ib.is_dir() and any(ib.iterdir())):
        os.environ.setdefault("UCX_MODULES", "^ib")
    tls = os.environ.get("UCX_TLS")
    if tls and not ({"tcp", "all"} & set(tls.replace("^", "").split(","))):
        log.warning("UCX_TLS=%s has no tcp: UCX needs tcp for wire-up and NIXL agent creation will fail", tls)


_prepare_env()
import nixl._api as nixl_api  # noqa: E402
from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402

_agent_lock = threading.Lock()


def _agent(name: str, config: Any, progress_delay_us: int) -> Any:
    """A nixl_agent whose progress thread waits `progress_delay_us` between looks instead of the
    wrapper's hard-coded 0. The wrapper builds its nixlAgentConfig inside __init__, so the config
    class is swapped for one that keeps our delay, for the length of that call only."""
    bind = nixl_api.nixlBind
    plain = bind.nixlAgentConfig

    class Config(plain):
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, progress_delay_us if key == "pthrDelay" else value)

    with _agent_lock:
        bind.nixlAgentConfig = Config
        try:
            return nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = plain


PREPPED_MIN_RUNS = 64  # fewer runs: building descriptors per transfer is cheaper than indexing
PREPPED_MAX_PAGES = 1 << 20


def _mem(device: str) -> tuple[str, int]:
    index = cuda_index(device)
    return ("DRAM", 0) if index is None else ("VRAM", index)


class NixlTransport(Transport):
    # num_threads: UCX workers; more than one overlaps the per-descriptor cost of scattered pages.
    # progress_delay_us: how long NIXL's progress thread waits for UCX events before it looks again.
    # NIXL's Python agent fixes it at 0, a busy loop that burns a core per idle agent; the thread sleeps
    # on UCX's event fd, so a transfer still wakes it at once (0 saves ~40 us on small reads only).
    OPTIONS = {"backends": ["UCX"], "num_threads": min(4, os.cpu_count() or 1), "progress_delay_us": 1000}
    SUPPORTS_STAGING = True

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        config = nixl_agent_config(backends=list(self.options["backends"]),
                                   num_threads=int(self.options["num_threads"]))
        self._agent = _agent(self.agent, config, int(self.options["progress_delay_us"]))
        self._reg_descs: list[Any] = []
        self._local_prepped: Any = None
        self._page_base: list[int] = []  # first page index of each local region in the prepped list

    def _path(self) -> str:
        mems = sorted({_mem(r.device)[0] for r in self.regions}) or ["DRAM"]
        return f"{'+'.join(self.options['backends']).lower()}(tls={os.environ.get('UCX_TLS', 'auto')}) {'+'.join(mems)}"

    def _register(self, regions: list[Region]) -> None:
        for r in regions:
            mem, dev = _mem(r.device)
            self._reg_descs.append(self._agent.register_memory([(r.addr, r.length, dev, "")], mem))
        self._release_prepped()

    def _metadata(self) -> dict[str, Any]:
        return {"nixl": self._agent.get_agent_metadata()}

    def _connect(self, d: Descriptor, peer: Peer) -> Any:
        name = self._agent.add_remote_agent(d.meta["nixl"])
        return {"name": name.decode() if isinstance(name, bytes) else name, "prepped": None, "page_base": None}

    # -- prepared descriptor lists -----------------------------------------------------------------

    def _prep(self, owner: str, regions: list[Region]) -> tuple[Any, list[int]] | None:
        pb = self.layout.page_bytes
        mems = {_mem(r.device) for r in regions}
        pages = sum(r.length // pb for r in regions)
        if len({m for m, _ in mems}) != 1 or pages > PREPPED_MAX_PAGES:
            return None
        mem = next(iter(mems))[0]
        descs, base = [], []
        for r in regions:
            base.append(len(descs))
            dev = _mem(r.device)[1]
            descs.extend((r.addr + j * pb, pb, dev) for j in range(r.length // pb))
        return self._agent.prep_xfer_dlist(owner, descs, mem), base

    def _page_indices(self, spans: np.ndarray, base: list[int]) -> np.ndarray:
        pb = self.layout.page_bytes
        first = np.asarray(base, dtype=np.int64)[spans[:, 0]] + spans[:, 1] // pb
        count = spans[:, 2] // pb
        starts = np.repeat(first - np.concatenate(([0], np.cumsum(count)[:-1])), count)
        return (starts + np.arange(int(count.sum()))).astype(np.int32)

    def _aligned(self, spans: np.ndarray) -> bool:
        pb = self.layout.page_bytes
        return bool((spans[:, 1] % pb == 0).all() and (spans[:, 2] % pb == 0).all())

    def _descs(self, spans: np.ndarray, regions: list[Region]) -> Any:
        mems = {_mem(regions[i].device) for i in np.unique(spans[:, 0])}
        if len({m for m, _ in mems}) != 1:
            raise ValueError("one transfer's spans must all be in host memory or all in GPU memory")
        devices = np.array([_mem(r.device)[1] for r in regions], dtype=np.uint64)[spans[:, 0]]
        table = np.column_stack((span_addresses(spans, regions), spans[:, 2].astype(np.uint64), devices))
        return self._agent.get_xfer_descs(table, next(iter(mems))[0])

    def _release_prepped(self) -> None:
        if self._local_prepped is not None:
            self._agent.release_dlist_handle(self._local_prepped)
            self._local_prepped = None

    # -- transfers ---------------------------------------------------------------------------------

    def _post(self, op: str, peer: Peer, local: np.ndarray, remote: np.ndarray, notify: bytes | None) -> Any:
        state = peer.backend
        handle = None
        if len(local) >= PREPPED_MIN_RUNS and self._aligned(local) and self._aligned(remote) \
                and local[:, 0].max() < len(self.regions) and remote[:, 0].max() < len(peer.regions):
            if self._local_prepped is None:
                prepped = self._prep("NIXL_INIT_AGENT", self.regions)
                if prepped:
                    self._local_prepped, self._page_base = prepped
            if state["prepped"] is None:
                state["prepped"], state["page_base"] = self._prep(state["name"], peer.regions) or (False, None)
            if self._local_prepped is not None and state["prepped"]:
                handle = self._agent.make_prepped_xfer(
                    op, self._local_prepped, self._page_indices(local, self._page_base),
                    state["prepped"], self._page_indices(remote, state["page_base"]), notify or b"")
        if handle is None:
            handle = self._agent.initialize_xfer(op, self._descs(local, self.all_regions),
                                                 self._descs(remote, peer.all_regions), state["name"], notify or b"")
        if self._agent.transfer(handle) == "ERR":
            self._agent.release_xfer_handle(handle)
            raise ConnectionError(f"NIXL refused to post the transfer to {peer.agent}")
        return handle

    def _poll(self, backend: Any) -> TransferStatus:
        state = self._agent.check_xfer_state(backend)
        if state == "DONE":
            return STATUS_DONE
        if state == "ERR":
            return failed("NIXL transfer error (peer gone or unreachable)")
        return STATUS_PENDING

    def _release(self, backend: Any, status: TransferStatus) -> None:
        if backend is not None:
            self._agent.release_xfer_handle(backend)

    def _slow_path_hint(self) -> str:
        return ("between processes on one GPU use transport 'local' (CUDA IPC), otherwise check UCX_TLS "
                "includes cuda_ipc")

    def _notifications(self) -> list[tuple[str, bytes]]:
        return [(agent.decode() if isinstance(agent, bytes) else agent, msg)
                for agent, msgs in self._agent.get_new_notifs().items() for msg in msgs]

    def _close(self) -> None:
        self._release_prepped()
        for descs in self._reg_descs:
            try:
                self._agent.deregister_memory(descs)
            except Exception:  # noqa: BLE001
                log.debug("nixl: deregister failed", exc_info=True)
        self._reg_descs.clear()
        del self._agent
