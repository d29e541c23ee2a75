"""PdsdkHiCacheStorage: SGLang's HiCache L3 storage over any pdsdk store.

    --enable-hierarchical-cache --hicache-mem-layout page_first --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "pdsdk",
      "module_path": "pdsdk.adapters.sglang.hicache", "class_name": "PdsdkHiCacheStorage",
      "store": {"tiered": ["memory", "disk"]}, "interface_v1": 1}'

(`command.hicache_args` writes this.) The store is `extra_config["store"]`, else the `store` of
PDSDK_CONFIG. SGLang builds the class as `cls(storage_config, {})` and then registers its host
memory pool. With `interface_v1` SGLang calls the zero-copy `batch_get_v1`/`batch_set_v1`: pages
move between the store and the host pool's own memory (`get_page_buffer_meta`); without it, the
legacy `batch_get`/`batch_set` on flat page tensors. Keys are SGLang's page hashes (hex SHA-256
chained over the prefix, as SGLang's get_hash_str) under a pdsdk namespace of model, host
layout and rank, one store key per buffer piece of a page (K and V). Hybrid models (Mamba, SWA,
DSA) use SGLang's v2 API, which this class does not implement: SGLang then reports it.
Never raises on the data path: a store outage reads as misses.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from pdsdk.connectors.stores.base import Hints, byte_view
from pdsdk.connectors.stores.factory import open_store
from pdsdk.connectors.transports.common.buffers import host_array

log = logging.getLogger(__name__)
LEGACY_PART = 0xFF  # key suffix of a whole flat page (legacy path); v1 pieces are 0, 1, ...


class PdsdkHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: Any = None, kwargs: dict | None = None, **_: Any):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.storage_config = storage_config
        spec = extra.get("store")
        if spec is None:
            from pdsdk.adapters.sglang.settings import config_from_env

            spec = config_from_env().store
            if spec is None:
                from pdsdk.errors import ConfigError

                raise ConfigError("hicache-storage-backend-extra-config store",
                                  'name a pdsdk store, e.g. "store": "memory", or set one in PDSDK_CONFIG')
        self.store = open_store(spec)
        self.zero_copy = bool(extra.get("interface_v1"))
        self.model = str(extra.get("model") or getattr(storage_config, "model_name", None) or "model")
        self.hints = Hints(**extra["retention"]) if extra.get("retention") else None
        self.mem_pool_host: Any = None
        self.parts = 1  # store keys per page on the v1 path (K and V pieces, per layer when layer_first)
        self._prefix = self._namespace("unregistered")

    # --- setup -------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        self.page_size = int(getattr(pool, "page_size", 1))
        shape = ",".join(str(getattr(pool, a, "")) for a in ("layout", "layer_num", "head_num", "head_dim", "dtype"))
        self._prefix = self._namespace(f"{shape},page={self.page_size}")
        if self.zero_copy:
            import torch

            ptrs, _ = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
            self.parts = max(1, len(ptrs))

    def _namespace(self, layout: str) -> bytes:
        """Who may share pages: the same model and host layout, and the same shard. MLA pages are
        the same on every TP rank; MHA pages hold one rank's heads."""
        c = self.storage_config
        mla = bool(getattr(c, "is_mla_model", False))
        shard = "*" if mla else f"tp{getattr(c, 'tp_rank', 0)}/{getattr(c, 'tp_size', 1)}"
        shard += f",pp{getattr(c, 'pp_rank', 0)}/{getattr(c, 'pp_size', 1)}"
        shard += f",cp{getattr(c, 'attn_cp_rank', 0)}/{getattr(c, 'attn_cp_size', 1)}"
        return hashlib.blake2b(f"pdsdk-hicache1|{self.model}|{layout}|{shard}".encode(), digest_size=16).digest()

    def _keys(self, keys: list[str], parts: int | None) -> list[bytes]:
        """Store keys, `parts` per page in page order (None: one whole-page key, legacy path)."""
        out = []
        for key in keys:
            base = self._prefix + _hash_bytes(key)
            out.extend([base + bytes([LEGACY_PART])] if parts is None else [base + bytes([j]) for j in range(parts)])
        return out

    # --- zero-copy path (interface_v1) ---------------------------------------------------------

    def _views(self, host_indices: Any) -> list[Any]:
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        return [host_array(int(p), int(n)) for p, n in zip(ptrs, sizes)]

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        try:
            views = self._views(host_indices)
            parts = len(views) // len(keys)
            skeys = self._keys(keys, parts)
            if self.store.put(skeys, views, self.hints) == len(skeys):
                return [True] * len(keys)
            return [self.store.contains(skeys[i * parts:(i + 1) * parts]) == parts for i in range(len(keys))]
        except Exception as e:  # noqa: BLE001 - a failed backup is a miss later, never a crash
            log.warning("pdsdk hicache: batch_set_v1 of %d pages failed: %s", len(keys), e)
            return [False] * len(keys)

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        try:
            views = self._views(host_indices)
            parts = len(views) // len(keys)
            full = self.store.get(self._keys(keys, parts), views) // parts
        except Exception as e:  # noqa: BLE001
            log.warning("pdsdk hicache: batch_get_v1 of %d pages failed: %s", len(keys), e)
            full = 0
        return [i < full for i in range(len(keys))]

    # --- existence ---------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many pages from the first are stored (SGLang's prefix semantics)."""
        if not keys:
            return 0
        parts = self.parts if self.zero_copy else None
        try:
            return self.store.contains(self._keys(keys, parts)) // (parts or 1)
        except Exception as e:  # noqa: BLE001
            log.warning("pdsdk hicache: batch_exists failed: %s", e)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- legacy path: flat page tensors --------------------------------------------------------

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        if not keys:
            return []
        if target_locations is None:
            raise ValueError("pdsdk hicache: batch_get needs target_locations (SGLang passes flat page buffers)")
        try:
            hits = self.store.get(self._keys(keys, None), [byte_view(t) for t in target_locations])
        except Exception as e:  # noqa: BLE001
            log.warning("pdsdk hicache: batch_get of %d pages failed: %s", len(keys), e)
            hits = 0
        return [t if i < hits else None for i, t in enumerate(target_locations)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not keys:
            return True
        try:
            pages = [byte_view(v.contiguous() if hasattr(v, "contiguous") else v) for v in values]
            return self.store.put(self._keys(keys, None), pages, self.hints) == len(keys)
        except Exception as e:  # noqa: BLE001
            log.warning("pdsdk hicache: batch_set of %d pages failed: %s", len(keys), e)
            return False

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    # --- housekeeping --------------------------------------------------------------------------

    def clear(self) -> None:
        clear = getattr(self.store, "clear", None)
        if clear is None:
            log.warning("pdsdk hicache: store %s cannot be cleared; its pages age out by its own policy",
                        self.store.name)
            return
        clear()

    def get_stats(self) -> Any:
        return None  # pdsdk stores report through `Store.stats()` and the pdsdk observation hooks

    def close(self) -> None:
        self.store.close()


def _hash_bytes(key: str) -> bytes:
    """SGLang's page hashes are hex SHA-256; anything else (suffixed or custom keys) is hashed."""
    try:
        return bytes.fromhex(key)
    except ValueError:
        return hashlib.blake2b(key.encode(), digest_size=32).digest()
