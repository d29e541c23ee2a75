"""The worker half of PdsdkConnector (one per TP rank, in vLLM's worker process).

It registers the KV cache with the chosen transport, publishes the descriptor through the
handshake, pulls pages for requests the scheduler names (decode), and releases pages the peer
has read or whose lease ran out (prefill). Failures become load errors for vLLM to recompute
(`kv_load_failure_policy: recompute`) or to fail; they never hang a step.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from pdsdk.adapters.side_channel import SECRET_KEY, fetch, secret_from
from pdsdk.adapters.vllm.metadata import PdsdkHandshake, PdsdkMetadata, Receive
from pdsdk.adapters.vllm.pages import (READ_NOTE, ReadTracker, block_geometry, block_spans, head_geometry, read_note,
                                       region_bytes)
from pdsdk.adapters.vllm.peers import Entry, Peers
from pdsdk.adapters.vllm.stats import StatsRecorder
from pdsdk.compat import vllm as compat
from pdsdk.config import PdsdkConfig
from pdsdk.connectors.transports.factory import open_transport
from pdsdk.kv import HeadGeometry, KVLayout, Region, head_plan, head_readers, head_slice_spans, rank_heads

log = logging.getLogger(__name__)
STATS_ENV = "PDSDK_STATS_DIR"


class WorkerSide:
    def __init__(self, vllm_config: Any, config: PdsdkConfig, engine_id: str, tp_rank: int):
        self.vllm_config = vllm_config
        self.config = config
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.transport: Any = None
        self.geometry: list[list[int]] = []
        self.layout: KVLayout | None = None
        self.heads: list[HeadGeometry] | str = "KV caches not registered"  # per layer, or why heads can't be sliced
        secret = secret_from(vllm_config.kv_transfer_config.get_from_extra_config(SECRET_KEY, None))
        self.peers = Peers(config.timeouts.connect_s, functools.partial(fetch, secret=secret))
        self._waiting: dict[str, Receive] = {}  # requests whose prefill ranks have not answered yet
        # request -> (handles, blocks, bytes, start, failed): one handle per prefill rank read
        self._loading: dict[str, tuple[list[int], list[int], int, float, bool]] = {}
        self._received: set[str] = set()
        self._load_errors: set[int] = set()
        self._sending: dict[str, float] = {}  # request -> lease expiry
        self._reads = ReadTracker()  # which requests every expected decode reader has read
        self._finished: set[str] = set()
        self.store_io: Any = None
        self.keyspace: Any = None  # the store's key namespace, published to the scheduler in the handshake
        self.stats = StatsRecorder()  # this step's numbers for vLLM's connector stats
        self._stopped = threading.Event()

    # --- start-up ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        tensors = list(kv_caches.values())
        self.geometry = [block_geometry(t, num_blocks) for t in tensors]
        model = self.vllm_config.model_config
        first = tensors[0]
        device = "cpu" if first.device.type == "cpu" else f"cuda:{first.device.index or 0}"
        layout = KVLayout(num_layers=len(tensors), num_kv_heads=model.get_total_num_kv_heads(),
                          head_dim=model.get_head_size(), page_size=self.vllm_config.cache_config.block_size,
                          dtype=str(first.dtype).removeprefix("torch."), kv_split=not model.use_mla,
                          device=device, tp_rank=self.tp_rank, tp_size=self.tp_size, hetero_tp=True)
        self.layout = layout
        self.heads = self._head_geometry(tensors, num_blocks)
        if os.environ.get(STATS_ENV):
            threading.Thread(target=self._write_stats_forever, args=(Path(os.environ[STATS_ENV]),),
                             name="pdsdk-stats", daemon=True).start()
        if self.config.store is not None:
            from pdsdk.adapters.vllm.store_path import StoreIO
            from pdsdk.connectors.stores.common.keys import KeySpace

            self.keyspace = KeySpace.for_layout(model.model, layout)
            self.store_io = StoreIO(self.config.store, self.keyspace, tensors, self.geometry, self.stats)
        spec = self.config.transport
        if spec is None:
            return
        self.transport = open_transport(spec, layout=layout, host=compat.engine_host(),
                                        transfer_timeout_s=self.config.timeouts.transfer_s,
                                        connect_timeout_s=self.config.timeouts.connect_s)
        self.transport.register([Region(t.data_ptr(), region_bytes(t), device) for t in tensors])
        log.info("pdsdk: %d KV layers registered with transport %s (%s), layout %s", len(tensors), spec.name,
                 self.transport.path(), layout.fingerprint())

    def _head_geometry(self, tensors: list[Any], num_blocks: int) -> list[HeadGeometry] | str:
        """Where the KV heads sit in each layer's blocks (for heterogeneous TP), or why they can't be sliced."""
        layout = self.layout
        if not layout.kv_split:
            return "MLA: the latent is replicated, whole blocks are read"
        try:
            _, local_heads = rank_heads(layout.num_kv_heads, self.tp_size, self.tp_rank)
        except ValueError as e:
            return str(e)
        heads = []
        for t in tensors:
            g = head_geometry(t, num_blocks, layout.page_size, local_heads)
            if isinstance(g, str):
                log.info("pdsdk: KV cache pages cannot be sliced by head (heterogeneous TP off): %s", g)
                return g
            heads.append(g)
        return heads

    def handshake(self) -> PdsdkHandshake | None:
        """The transport descriptor (for PD peers, through the side channel) and the store key namespace
        (for the scheduler's lookups in a shared store): None when this engine has neither."""
        if self.transport is None and self.keyspace is None:
            return None
        heads = [list(msgspec.structs.astuple(g)) for g in self.heads] if isinstance(self.heads, list) else None
        return PdsdkHandshake(tp_rank=self.tp_rank, descriptor=self.transport.descriptor() if self.transport else b"",
                              geometry=self.geometry, heads=heads,
                              store_keyspace=msgspec.structs.asdict(self.keyspace) if self.keyspace else None)

    # --- every step ----------------------------------------------------------------------------

    def start_load_kv(self, meta: PdsdkMetadata) -> None:
        for request_id, pages in meta.load.items():
            self.store_io.start_load(request_id, pages)
        self._sending.update(meta.send)
        for request_id, receive in meta.receive.items():
            self._start_receive(request_id, receive)

    def _start_receive(self, request_id: str, r: Receive) -> None:
        handles: list[int] = []
        start = time.monotonic()
        nbytes = 0
        try:
            if self.transport is None:
                raise RuntimeError("this engine has no transport configured (pdsdk config 'transport')")
            if not r.remote_block_ids or len(r.remote_block_ids) != len(r.local_block_ids):
                raise ValueError(f"{len(r.local_block_ids)} local blocks for {len(r.remote_block_ids)} remote ones")
            if r.lease_expiry is not None and time.time() > r.lease_expiry - 1.0:
                raise TimeoutError("the prefill's lease on these blocks has expired")
            plan = None if r.tp_size == self.tp_size else \
                head_plan(self.layout.num_kv_heads, r.tp_size, self.tp_size, self.tp_rank, self.layout.kv_split)
            ranks = [self.tp_rank] if plan is None else [read.remote_rank for read in plan]
            if any([self._peer(r, rank) is None for rank in ranks]):  # ask every rank now, not one per step
                self._waiting[request_id] = r  # asked again at the next step
                return
            if r.tp_size == self.tp_size:  # same TP: whole blocks from the prefill rank of our rank
                peer, geometry, _ = self._peer(r, self.tp_rank)
                local = block_spans(r.local_block_ids, self.geometry)
                handles.append(self.transport.read(peer, local, block_spans(r.remote_block_ids, geometry),
                                                   notify=READ_NOTE + r.request_id.encode()))
                nbytes = int(local[:, 2].sum())
            else:
                nbytes = self._start_hetero(r, plan, handles)
            self._loading[request_id] = (handles, r.local_block_ids, nbytes, start, False)
        except Exception as e:  # noqa: BLE001 - a failed load is recomputed or failed by vLLM, never raised
            log.error("pdsdk: KV load for request %s from %s failed: %s: %s", request_id, r.engine_id,
                      type(e).__name__, e)
            if handles:  # reads already posted still write into our blocks: report once they are over
                self._loading[request_id] = (handles, r.local_block_ids, nbytes, start, True)
            else:
                self.stats.add(transfer_failures=1)
                self._fail(request_id, r.local_block_ids)

    def _start_hetero(self, r: Receive, plan: list, handles: list[int]) -> int:
        """Prefill TP != decode TP: one read per prefill rank holding some of our KV heads (page slices
        by head), or, for MLA, whole blocks of a share of the layers. Appends the handles; returns bytes."""
        layout = self.layout
        nbytes = 0
        for read in plan:
            peer, geometry, heads = self._peer(r, read.remote_rank)
            if peer.layout.tp_size != r.tp_size:
                raise ValueError(f"prefill rank {read.remote_rank} has TP={peer.layout.tp_size}, its params say "
                                 f"TP={r.tp_size}")
            if layout.kv_split:
                if isinstance(self.heads, str):
                    raise NotImplementedError(f"prefill TP={r.tp_size}, decode TP={self.tp_size}: this decode "
                                              f"rank cannot slice its pages by KV head: {self.heads}")
                if heads is None:
                    raise NotImplementedError(f"prefill TP={r.tp_size}, decode TP={self.tp_size}: prefill rank "
                                              f"{read.remote_rank} cannot slice its pages by KV head (see its log)")
                local, remote = head_slice_spans(r.local_block_ids, self.geometry, self.heads, r.remote_block_ids,
                                                 geometry, heads, read)
            else:  # MLA: the latent is the same on every rank
                local, remote = block_spans(r.local_block_ids, self.geometry), block_spans(r.remote_block_ids, geometry)
                keep = local[:, 0] % read.parts == read.part
                local, remote = local[keep], remote[keep]
            if not len(local):
                continue
            readers = head_readers(layout.num_kv_heads, r.tp_size, self.tp_size, read.remote_rank, layout.kv_split)
            handles.append(self.transport.read(peer, local, remote,
                                               notify=read_note(r.request_id, self.tp_rank, readers)))
            nbytes += int(local[:, 2].sum())
        return nbytes

    def _peer(self, r: Receive, remote_rank: int) -> Entry | None:
        """The connected prefill rank; None while its side channel is being asked (see peers.py)."""
        return self.peers.get((r.engine_id, remote_rank), r.host, r.port, self.transport.connect)

    def _fail(self, request_id: str, local_block_ids: list[int]) -> None:
        self._load_errors.update(local_block_ids)
        self._received.add(request_id)  # vLLM wants failed loads reported as finished, with the errors

    def save(self, pages: list) -> None:
        if self.store_io is not None:
            self.store_io.save(pages)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        waiting, self._waiting = self._waiting, {}
        for request_id, receive in waiting.items():
            self._start_receive(request_id, receive)
        if self.store_io is not None:
            loaded, errors = self.store_io.finished_loads()
            self._received |= loaded
            self._load_errors |= errors
        if self.transport is None:
            received, self._received = self._received, set()
            return None, received or None
        for request_id, (handles, blocks, nbytes, start, failed) in list(self._loading.items()):
            statuses = [self.transport.poll(h) for h in handles]
            if not all(s.final for s in statuses):
                continue
            del self._loading[request_id]
            for h in handles:
                self.transport.release(h)
            status = next((s for s in statuses if s.state != "done"), statuses[0])
            if failed:
                self.stats.add(transfer_failures=1)
                self._fail(request_id, blocks)
            elif status.state == "done":
                self.stats.add(transfers=1, transfer_bytes=nbytes)
                self.stats.time("transfer_seconds", time.monotonic() - start)
                self._received.add(request_id)
            else:
                log.error("pdsdk: KV load for request %s failed: %s", request_id, status.reason)
                self.stats.add(transfer_failures=1)
                self._fail(request_id, blocks)
        now = time.time()
        for _, note in self.transport.notifications():
            self._reads.note(note, now)
        self._finished |= finished_req_ids
        read = self._reads.read
        done = {r for r, expiry in self._sending.items()
                if r in self._finished and (r in read or now > expiry)}
        for r in done:
            if r not in read:
                log.warning("pdsdk: lease of request %s expired before every decode reader read it", r)
            del self._sending[r]
            self._reads.forget(r)
        self._finished &= set(self._sending)
        self._reads.expire(now, 2 * self.config.timeouts.lease_s)
        received, self._received = self._received, set()
        return done or None, received or None

    def _write_stats_forever(self, directory: Path) -> None:
        """Transfer and store stats as JSON under $PDSDK_STATS_DIR (set by `pdsdk launch`), once a second
        when they change: the worker process has no endpoint of its own, and an idle engine runs no steps."""
        path = directory / f"{self.engine_id}-tp{self.tp_rank}.json"
        directory.mkdir(parents=True, exist_ok=True)
        written = None
        while not self._stopped.wait(1.0 if written is not None else 0.0):
            stats = {"engine_id": self.engine_id, "tp_rank": self.tp_rank,
                     **(self.transport.stats() if self.transport is not None else {}),
                     "store": self.store_io.store.stats() if self.store_io is not None else None}
            if stats != written:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(stats))
                tmp.replace(path)
                written = stats

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._stopped.set()
        self.peers.close()
        if self.transport is not None:
            self.transport.close()
        if self.store_io is not None:
            self.store_io.close()
