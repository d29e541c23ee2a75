"""The scheduler half of PdsdkConnector (runs in vLLM's EngineCore process).

Prefill (kv_producer): after a request with `do_remote_decode` finishes, keep its blocks under a
lease and answer with the `kv_transfer_params` a decode engine needs. Decode (kv_consumer): for a
request carrying those params, claim the prompt's tokens as external, load them asynchronously,
and tell the workers which blocks to pull. The request-level protocol is NixlConnector's, so the
proxies people already run drive this connector unchanged.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pdsdk.adapters.side_channel import SECRET_KEY, Entry, SideChannelServer, secret_from
from pdsdk.adapters.vllm.metadata import PdsdkHandshake, PdsdkMetadata, Receive, StorePages
from pdsdk.adapters.vllm.stats import StatsRecorder
from pdsdk.adapters.vllm.store_path import INDEX_LIMIT, StoreIndex, StoreLookup, shared_spec
from pdsdk.compat import vllm as compat
from pdsdk.config import PdsdkConfig

log = logging.getLogger(__name__)
NEEDED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids")


class SchedulerSide:
    def __init__(self, vllm_config: Any, config: PdsdkConfig, engine_id: str, fingerprint: str):
        kv = vllm_config.kv_transfer_config
        self.config = config
        self.engine_id = engine_id
        self.fingerprint = fingerprint
        self.is_producer = kv.kv_role in ("kv_producer", "kv_both")
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self.host = compat.engine_host()
        self.side_channel = SideChannelServer(self.host, int(kv.get_from_extra_config("side_channel_port", 0)),
                                              secret_from(kv.get_from_extra_config(SECRET_KEY, None)))
        self._receive: dict[str, Receive] = {}
        self._send: dict[str, float] = {}
        # Store path: what the workers saved, and per request what is loaded or saved so far.
        self.store_index = StoreIndex() if config.store is not None else None
        self.stats = StatsRecorder()
        shared = shared_spec(config.store)
        self.store_lookup = StoreLookup(shared, self.stats) if shared is not None else None
        self._lookups: dict[str, tuple[int, int]] = {}  # request -> (first block, hits): one lookup per request
        self._requests: dict[str, Any] = {}
        self._blocks: dict[str, list[int]] = {}
        self._stored: dict[str, int] = {}  # request -> full blocks already in the store
        self._store_hits: dict[str, tuple[int, int]] = {}  # request -> (first block, blocks) to load
        self._load: dict[str, StorePages] = {}
        self._pd_first: dict[str, int] = {}  # decode: first remote block to pull (after local hits)
        self.store_hit_blocks = 0
        self._saved_ranks: dict[bytes, int] = {}  # TP > 1: hash -> ranks whose save of it landed

    # --- handshake -----------------------------------------------------------------------------

    def set_handshakes(self, metadata: dict[int, PdsdkHandshake]) -> None:
        for rank, meta in metadata.items():
            if meta.descriptor:
                self.side_channel.entries[rank] = Entry(descriptor=meta.descriptor, geometry=meta.geometry,
                                                        heads=getattr(meta, "heads", None), tp_rank=rank,
                                                        engine_id=self.engine_id)
        if self.side_channel.entries:
            log.info("pdsdk: side channel %s:%d serves %d worker(s)", self.host, self.side_channel.port,
                     len(self.side_channel.entries))
        keyspaces = [meta.store_keyspace for _, meta in sorted(metadata.items())
                     if getattr(meta, "store_keyspace", None)]
        if self.store_lookup is not None and keyspaces:
            from pdsdk.connectors.stores.common.keys import KeySpace

            self.store_lookup.set_keyspaces([KeySpace(**k) for k in keyspaces])
            log.info("pdsdk: prefix lookups in the shared store %s (%d key namespace(s))",
                     self.store_lookup.spec.name, len(self.store_lookup.keyspaces))

    # --- decode side ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and all(params.get(k) is not None for k in NEEDED):
            remote_tokens = params.get("remote_num_tokens") or request.num_prompt_tokens
            count = min(remote_tokens, request.num_prompt_tokens) - num_computed_tokens
            if count > 0:
                self._pd_first[request.request_id] = num_computed_tokens // self.block_size
                return count, True
            return 0, False
        if self.store_index is None:
            return 0, False
        self._requests[request.request_id] = request
        first = num_computed_tokens // self.block_size
        # Blocks the engine's own prefix cache holds were saved by the request that computed them.
        self._stored[request.request_id] = max(self._stored.get(request.request_id, 0), first)
        last = (request.num_prompt_tokens - 1) // self.block_size  # vLLM computes at least one token
        hits = self._store_prefix(request.request_id, first, list(request.block_hashes[first:last]))
        if hits:
            self._store_hits[request.request_id] = (first, hits)
            return hits * self.block_size, True
        return 0, False

    def _store_prefix(self, request_id: str, first: int, hashes: list[bytes]) -> int:
        """Blocks of `hashes` in the store: what this engine saved (its index), then what the shared store
        holds beyond that (asked once per request and first block; vLLM may ask again while it waits)."""
        hits = self.store_index.hit_prefix(hashes)
        if self.store_lookup is None or hits == len(hashes):
            return hits
        memo = self._lookups.get(request_id)
        if memo is not None and memo[0] == first:
            return max(hits, memo[1])
        found = hits + self.store_lookup.hit_prefix(hashes[hits:])
        self._lookups[request_id] = (first, found)
        return found

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        self._lookups.pop(request.request_id, None)
        hit = self._store_hits.pop(request.request_id, None)
        if hit is not None and num_external_tokens > 0:
            first, n = hit
            local = compat.unhashed_block_ids(blocks)[:n]
            self._load[request.request_id] = StorePages(local, list(request.block_hashes[first:first + n]))
            self._stored[request.request_id] = first + n
            self.store_hit_blocks += n
        if not params or not params.get("do_remote_prefill"):
            return
        if num_external_tokens > 0 and all(params.get(k) is not None for k in NEEDED):
            # The external tokens are the prompt's tail after local prefix-cache hits (block aligned):
            # the last n remote blocks land in the first n newly allocated local blocks.
            # Remote block i holds the prefill's tokens [i*bs, (i+1)*bs): start after our local hits,
            # whatever the prefill allocated beyond its prompt.
            n = -(-num_external_tokens // self.block_size)
            first = self._pd_first.pop(request.request_id, 0)
            local = compat.unhashed_block_ids(blocks)[:n]
            remote = _flat(params["remote_block_ids"])[first:first + n]
            if len(local) != len(remote):
                log.warning("pdsdk: request %s: %d local blocks for %d remote ones; its load will fail",
                            request.request_id, len(local), len(remote))
                remote = []  # the worker reports every local block as a load error
            self._receive[request.request_id] = Receive(
                local_block_ids=local, remote_block_ids=remote,
                engine_id=params["remote_engine_id"], request_id=params["remote_request_id"],
                host=params["remote_host"], port=int(params["remote_port"]), tp_size=int(params.get("tp_size", 1)),
                lease_expiry=(params.get("pdsdk") or {}).get("lease_expiry"))
        params["do_remote_prefill"] = False  # one transfer per request, however often vLLM asks

    # --- prefill side --------------------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        for table in (self._requests, self._blocks, self._stored, self._store_hits, self._pd_first, self._lookups):
            table.pop(request.request_id, None)
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # decode request aborted before its load was scheduled
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode") or request.status not in compat.finished_statuses():
            return False, None
        block_ids = _flat(block_ids)
        expiry = time.time() + self.config.timeouts.lease_s
        if block_ids:
            self._send[request.request_id] = expiry
        return bool(block_ids), {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": block_ids, "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id, "remote_host": self.host,
            "remote_port": self.side_channel.port, "tp_size": self.tp_size,
            "remote_num_tokens": request.num_computed_tokens,
            "pdsdk": {"transport": self.config.transport.name if self.config.transport else None,
                      "fingerprint": self.fingerprint, "lease_expiry": expiry},
        }

    # --- every step ----------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> PdsdkMetadata:
        meta = PdsdkMetadata(receive=self._receive, send=self._send, load=self._load,
                             save=self._pages_to_save(scheduler_output) if self.store_index is not None else [])
        self._receive, self._send, self._load = {}, {}, {}
        return meta

    def _pages_to_save(self, out: Any) -> list[StorePages]:
        """Full prompt blocks this step computes, not yet in the store."""
        for new in out.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_ids is not None and req_id in self._blocks:
                self._blocks[req_id].extend(new_ids[0])
        pages = []
        for req_id, scheduled in out.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None or req_id not in self._blocks or (request.kv_transfer_params or {}).get(
                    "remote_engine_id"):  # decode of a PD pair: the prefill engine computed these
                continue
            done = min((request.num_computed_tokens + scheduled) // self.block_size,
                       request.num_prompt_tokens // self.block_size, len(request.block_hashes),
                       len(self._blocks[req_id]))
            start = self._stored.get(req_id, 0)
            if done > start:
                # Blocks another request saved already are skipped; the index learns new ones when they land.
                new = [(b, h) for b, h in zip(self._blocks[req_id][start:done], request.block_hashes[start:done])
                       if h not in self.store_index]
                if new:
                    pages.append(StorePages([b for b, _ in new], [h for _, h in new]))
                self._stored[req_id] = done
        return pages

    def update_connector_output(self, output: Any) -> None:
        """Blocks whose saves landed on every TP rank (reported in the workers' stats) join the index."""
        stats = getattr(output, "kv_connector_stats", None)
        if self.store_index is None or not hasattr(stats, "take_saved"):
            return
        saved = stats.take_saved()
        if self.tp_size == 1:
            self.store_index.add(saved)
            return
        landed = []
        for h in saved:
            n = self._saved_ranks.pop(h, 0) + 1
            if n == self.tp_size:
                landed.append(h)
            else:
                self._saved_ranks[h] = n
        while len(self._saved_ranks) > INDEX_LIMIT:  # a rank that never reports must not grow this forever
            self._saved_ranks.pop(next(iter(self._saved_ranks)))
        self.store_index.add(landed)

    def shutdown(self) -> None:
        self.side_channel.close()
        if self.store_lookup is not None:
            self.store_lookup.close()


def _flat(block_ids: Any) -> list[int]:
    """NixlConnector-style params carry one list per KV-cache group; pdsdk uses group 0."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return [int(b) for b in block_ids[0]]
    return [int(b) for b in block_ids or []]
