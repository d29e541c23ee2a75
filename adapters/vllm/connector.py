"""PdsdkConnector: vLLM's KVConnectorBase_V1 over any pdsdk transport and store.

vLLM builds one instance per role: SCHEDULER in the EngineCore process, WORKER in each worker
process; each delegates to its half (scheduler.py, worker.py). The pdsdk config is
`kv_connector_extra_config` (see docs/config.md), validated here with errors naming the field.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from pdsdk.adapters.vllm.metadata import PdsdkMetadata
from pdsdk.compat import vllm as compat
from pdsdk.config import load_config

log = logging.getLogger(__name__)
# kv_connector_extra_config keys that belong to this adapter rather than to the pdsdk config.
ADAPTER_KEYS = ("side_channel_port", "side_channel_secret")


class PdsdkConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        compat.check_supported()
        kv = vllm_config.kv_transfer_config
        extra = {k: v for k, v in (kv.kv_connector_extra_config or {}).items() if k not in ADAPTER_KEYS}
        self.config = load_config(extra)
        if self.config.failure_policy != kv.kv_load_failure_policy:
            log.warning("pdsdk: failure_policy=%s but vLLM's kv_load_failure_policy=%s; vLLM's setting decides "
                        "what a failed KV load does (set both the same)", self.config.failure_policy,
                        kv.kv_load_failure_policy)
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from pdsdk.adapters.vllm.scheduler import SchedulerSide

            self._scheduler = SchedulerSide(vllm_config, self.config, kv.engine_id, self.config.fingerprint())
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from pdsdk.adapters.vllm.worker import WorkerSide

            self._worker = WorkerSide(vllm_config, self.config, kv.engine_id, get_tensor_model_parallel_rank())

    # --- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks)

    def get_handshake_metadata(self) -> Any:
        return self._worker.handshake() if self._worker else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, PdsdkMetadata):
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous and whole-request: nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """The pull model saves nothing per layer: decode reads the pages once prefill is done."""

    def wait_for_save(self) -> None:
        """Copy this step's new full blocks out for the store; the store write happens off the step."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(meta, PdsdkMetadata) and meta.save:
            self._worker.save(meta.save)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # --- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> PdsdkMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._scheduler.set_handshakes(metadata)

    # --- stats (vLLM's connector stats: logged as "KV Transfer metrics", and vllm:pdsdk_* on /metrics) ---

    def get_kv_connector_stats(self) -> Any:
        """This step's numbers (worker: transfers and store I/O; scheduler: shared-store lookups), or None."""
        side = self._worker or self._scheduler
        return side.stats.take() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        from pdsdk.adapters.vllm.stats import PdsdkStats

        return PdsdkStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from pdsdk.adapters.vllm.stats import PdsdkPromMetrics

        if PdsdkPromMetrics is None:
            return None
        return PdsdkPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+: sleep mode frees and remaps the KV cache; the transports' registrations (NIXL,
        Mooncake, CUDA IPC handles) would point at the old memory, so vLLM refuses the combination."""
        return False

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.shutdown()
