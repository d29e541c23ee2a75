"""`local`: the same-host fast path.

Host memory moves with one copy straight between the two address spaces
(`process_vm_readv`/`process_vm_writev`, the kernel's cross-memory attach): no shared-memory
staging, no socket, and the peer spends no CPU. GPU memory moves through CUDA IPC handles: the
peer's allocation is opened in this process and one gather kernel copies every page over
NVLink/PCIe. Notifications travel on a small control channel.

Works only between processes on one host (checked at connect); use nixl or mooncake across hosts.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from pdsdk.connectors.transports.base import Transport
from pdsdk.connectors.transports.common.buffers import cuda_index
from pdsdk.connectors.transports.common.control import ControlChannel
from pdsdk.connectors.transports.common.descriptor import Descriptor, Peer
from pdsdk.connectors.transports.common.futures import all_of, byte_parts
from pdsdk.connectors.transports.common.status import STATUS_DONE, STATUS_PENDING, TransferStatus, failed
from pdsdk.connectors.transports.local.cma import MAX_CALL_BYTES, cma_copy, host_identity
from pdsdk.connectors.transports.local.cuda_ipc import CudaIpc
from pdsdk.errors import TransportError
from pdsdk.kv import Region, span_addresses, split_spans

log = logging.getLogger(__name__)

GPU_KERNELS = ("auto", "triton", "torch")


class LocalTransport(Transport):
    # threads: host copies run on this many threads (the peer spends no CPU).
    # gpu_kernel: how pages move between GPUs: "triton" (one pass), "torch" (index_select + index_copy_),
    # or "auto": Triton where it is usable, else torch.
    OPTIONS = {"threads": 2, "gpu_kernel": "auto"}
    # CUDA IPC has no host path to fall back to: a slow transfer here is a busy GPU or a queue.
    MAY_TAKE_HOST_PATH = False

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        if self.options["gpu_kernel"] not in GPU_KERNELS:
            from pdsdk.errors import ConfigError

            raise ConfigError("transport.options.gpu_kernel",
                              f"{self.options['gpu_kernel']!r} is not one of: {', '.join(GPU_KERNELS)}")
        self._identity = host_identity()
        self._notes: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        self._control = ControlChannel(self.agent, self.host, self._on_message)
        self._pool = ThreadPoolExecutor(int(self.options["threads"]), thread_name_prefix=f"pdsdk-local-{self.agent}")
        self._ipc: CudaIpc | None = None
        self._exports: list[dict[str, Any] | None] = []
        self._gpu_streams: dict[int, Any] = {}
        self._views: dict[tuple[int, int, int], Any] = {}
        self._lock_ipc = threading.Lock()

    def _path(self) -> str:
        devices = {r.device.split(":")[0] for r in self.regions} or {"cpu"}
        kernel = self.options["gpu_kernel"]
        # auto: not decided until the first GPU transfer
        gpu = "cuda-ipc" if kernel == "auto" else f"cuda-ipc ({kernel} page kernel)"
        return "+".join(sorted({"cpu": "cma", "cuda": gpu}[d] for d in devices))

    def _register(self, regions: list[Region]) -> None:
        for r in regions:
            if cuda_index(r.device) is None:
                self._exports.append(None)
            else:
                self._exports.append(self._cuda().export(r))

    def _cuda(self) -> CudaIpc:
        with self._lock_ipc:
            if self._ipc is None:
                self._ipc = CudaIpc()
            return self._ipc

    def _metadata(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "identity": self._identity, "control": self._control.address,
                "exports": self._exports}

    def _connect(self, d: Descriptor, peer: Peer) -> Any:
        if d.meta.get("identity") != self._identity:
            raise TransportError(f"transport 'local' moves memory between processes of one host; peer {d.agent} "
                                 f"on {d.host} is on another host or pid namespace: use nixl or mooncake")
        meta = dict(d.meta)
        meta["addrs"] = {}  # region index -> address of the peer's GPU region, opened here on first use
        return meta

    def _remote_cuda_addr(self, peer: Peer, index: int, device: int) -> int:
        meta = peer.backend
        if index not in meta["addrs"]:
            meta["addrs"][index] = self._cuda().open(meta["exports"][index], device)
        return meta["addrs"][index]

    def _post(self, op: str, peer: Peer, local: np.ndarray, remote: np.ndarray, notify: bytes | None) -> Any:
        on_gpu = [cuda_index(self.regions[i].device) is not None for i in np.unique(local[:, 0])]
        on_gpu += [cuda_index(peer.regions[i].device) is not None for i in np.unique(remote[:, 0])]
        if any(on_gpu):
            if not all(on_gpu):
                raise TransportError("local: host<->GPU transfers are not supported; register both sides on GPU "
                                     "or both on host")
            future = self._copy_gpu(op, peer, local, remote)
        else:
            future = self._copy_host(op, peer, local, remote)
        return future, peer, notify

    def _copy_host(self, op: str, peer: Peer, local: np.ndarray, remote: np.ndarray) -> Future:
        pid = peer.backend["pid"]
        threads = int(self.options["threads"])
        total = int(local[:, 2].sum())
        # Large transfers are cut into `threads` parts of about equal bytes, one per core.
        part = max(8 << 20, -(-total // threads))
        local, remote = split_spans(local, remote, min(part, MAX_CALL_BYTES))
        laddr, raddr = span_addresses(local, self.regions), span_addresses(remote, peer.regions)
        lengths = local[:, 2].astype(np.uint64)
        return all_of([self._pool.submit(cma_copy, op, pid, laddr[p], raddr[p], lengths[p])
                       for p in byte_parts(local[:, 2], threads)])

    def _post_pages(self, op: str, peer: Peer, local_region: int, local_pages: np.ndarray, remote_region: int,
                    remote_pages: np.ndarray, notify: bytes | None) -> Any:
        lreg, rreg = self.regions[local_region], peer.regions[remote_region]
        device = cuda_index(lreg.device)
        if device is None or cuda_index(rreg.device) is None:  # host pages: the span path batches iovecs
            from pdsdk.kv import page_spans

            pb = self.layout.page_bytes
            return self._post(op, peer, page_spans(local_region, local_pages, pb),
                              page_spans(remote_region, remote_pages, pb), notify)
        torch = self._cuda().torch
        pb = self.layout.page_bytes
        copy_pages = self._page_copier(device)
        stream = self._stream(device)
        with torch.cuda.stream(stream):
            lp = self._view(lreg.addr, lreg.length // pb * pb, device).view(-1, pb)
            rp = self._view(self._remote_cuda_addr(peer, remote_region, device), rreg.length // pb * pb,
                            device).view(-1, pb)
            if op == "READ":
                copy_pages(lp, local_pages, rp, remote_pages)
            else:
                copy_pages(rp, remote_pages, lp, local_pages)
            event = torch.cuda.Event()
            event.record(stream)
        future: Future = Future()
        future.event = event
        return future, peer, notify

    def _stream(self, device: int) -> Any:
        stream = self._gpu_streams.get(device)
        if stream is None:  # one per device, made once (creating a stream per transfer costs tens of us)
            stream = self._gpu_streams[device] = self._cuda().torch.cuda.Stream(device=device)
        return stream

    def _page_copier(self, device: int) -> Any:
        """dst[dst_idx] = src[src_idx] for page-shaped GPU tensors, by the configured kernel."""
        from pdsdk.connectors.transports.common.packing import copy_pages

        kernel = self.options["gpu_kernel"]
        if kernel != "torch":
            from pdsdk.connectors.transports.local.triton_copy import copy_pages_triton, triton_works

            if triton_works(device):
                self.options["gpu_kernel"] = "triton"
                return copy_pages_triton
            if kernel == "triton":
                log.warning("local: gpu_kernel 'triton' asked for but Triton is not usable here; using torch")
            self.options["gpu_kernel"] = "torch"  # ask once
        return copy_pages

    def _view(self, addr: int, length: int, device: int) -> Any:
        """Cached tensor over a region: making one from a raw pointer costs more than a small copy."""
        from pdsdk.connectors.transports.common.buffers import torch_view

        key = (addr, length, device)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = torch_view(addr, length, f"cuda:{device}")
        return view

    def _copy_gpu(self, op: str, peer: Peer, local: np.ndarray, remote: np.ndarray) -> Future:
        """Few runs: one copy each (no temporary). Many: one gather/scatter kernel pair per region pair."""
        from pdsdk.connectors.transports.common.packing import common_page, page_indices

        torch = self._cuda().torch
        device = cuda_index(self.regions[int(local[0, 0])].device)
        copy_pages = self._page_copier(device)
        page = common_page(local, remote)
        stream = self._stream(device)
        with torch.cuda.stream(stream):
            # Group spans by (local region, peer region); the common case has one of each.
            multi = len(self.regions) * len(peer.regions) > 1
            keys = local[:, 0] * len(peer.regions) + remote[:, 0] if multi else None
            for key in np.unique(keys) if multi else (0,):
                lr, rr = divmod(int(key), len(peer.regions))
                rows = np.flatnonzero(keys == key) if multi else slice(None)
                lreg, rreg = self.regions[lr], peer.regions[rr]
                lview = self._view(lreg.addr, lreg.length, device)
                rview = self._view(self._remote_cuda_addr(peer, rr, device), rreg.length, device)
                few = (len(rows) if isinstance(rows, np.ndarray) else len(local)) <= 16
                if not few and page is not None and lreg.length % page == 0 and rreg.length % page == 0:
                    li = page_indices(local[rows, 1], local[rows, 2], page)
                    ri = page_indices(remote[rows, 1], remote[rows, 2], page)
                    lp, rp = lview.view(-1, page), rview.view(-1, page)
                    if op == "READ":
                        copy_pages(lp, li, rp, ri)
                    else:
                        copy_pages(rp, ri, lp, li)
                else:
                    for (lo, n), ro in zip(local[rows, 1:].tolist(), remote[rows, 1].tolist()):
                        src, dst = (rview[ro:ro + n], lview[lo:lo + n]) if op == "READ" else \
                            (lview[lo:lo + n], rview[ro:ro + n])
                        dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        future: Future = Future()
        future.event = event  # polled, not waited
        return future

    def _poll(self, backend: Any) -> TransferStatus:
        future, peer, notify = backend
        event = getattr(future, "event", None)
        if event is not None:
            if not event.query():
                return STATUS_PENDING
        elif not future.done():
            return STATUS_PENDING
        elif future.exception() is not None:
            e = future.exception()
            return failed(f"{type(e).__name__}: {e}")
        if notify is not None:
            self._control.send(peer.backend["control"], {"op": "notify", "msg": notify})
        return STATUS_DONE

    def _on_message(self, sender: str, message: dict[str, Any]) -> None:
        if message.get("op") == "notify":
            self._notes.put((sender, message["msg"]))

    def _notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while not self._notes.empty():
            out.append(self._notes.get_nowait())
        return out

    def _close(self) -> None:
        self._views.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._control.close()
        if self._ipc is not None:
            self._ipc.close()
