"""PdsdkHiCacheStorage built by SGLang's own StorageBackendFactory through `dynamic`, over each pdsdk
store, against SGLang's real host KV pool (page_first, CPU): pages written from the pool come back
into other pool slots byte for byte, on the zero-copy (interface_v1) and the legacy path."""

from __future__ import annotations

import pytest
import torch
from stores.servers import mooncake_master, mooncake_options, redis_server  # noqa: F401 - fixtures

from pdsdk.compat import sglang as compat
from pdsdk.connectors.stores.common.keys import sglang_page_hashes

PAGE, LAYERS, HEADS, HEAD_DIM = 16, 3, 2, 32


@pytest.fixture(scope="module")
def host_pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kv = MHATokenToKVPool(256, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False, enable_alt_stream=False)
    try:  # 0.5.23: built from the device pool's buffer info
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        pool = MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, "page_first",
                                    pin_memory=False, device="cpu", device_capacity_tokens=kv.size,
                                    start_layer=kv.start_layer, end_layer=kv.end_layer)
    except ImportError:  # 0.5.15: from the device pool itself
        from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost

        pool = MHATokenToKVPoolHost(kv, 2, 0, PAGE, "page_first", pin_memory=False, device="cpu")
    g = torch.Generator().manual_seed(3)
    pool.kv_buffer.view(torch.int16).copy_(torch.randint(-2**15, 2**15, pool.kv_buffer.shape, generator=g,
                                                         dtype=torch.int16))
    return pool


def store_specs(tmp_path, request) -> dict:
    disk = {"name": "disk", "options": {"path": str(tmp_path / "disk")}}
    specs = {"memory": "memory", "disk": disk, "tiered": {"tiered": ["memory", disk]}}
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        specs["redis"] = {"name": "redis", "options": {"url": f"redis://127.0.0.1:{server.port}/0"}}
    if request.param == "mooncake":
        specs["mooncake"] = {"name": "mooncake", "options": mooncake_options(request.getfixturevalue("mooncake_master"))}
    return specs[request.param]


@pytest.fixture(params=["memory", "disk", "tiered", "redis", "mooncake"])
def store(tmp_path, request):
    return store_specs(tmp_path, request)


def make_storage(store, pool, *, zero_copy: bool):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from pdsdk.adapters.sglang.hicache import PdsdkHiCacheStorage

    extra = {"backend_name": "pdsdk", "module_path": "pdsdk.adapters.sglang.hicache",
             "class_name": "PdsdkHiCacheStorage", "store": store, "interface_v1": int(zero_copy)}
    config = compat.storage_config(extra_config=extra, model_name="tiny", is_page_first_layout=True)
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(storage, PdsdkHiCacheStorage)
    storage.register_mem_pool_host(pool)  # what the cache controller does after building it
    return storage


def slots(first_page: int, n: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)


def page_bytes(pool, first_page: int, n: int) -> bytes:
    return pool.kv_buffer[:, first_page * PAGE:(first_page + n) * PAGE].contiguous().view(torch.uint8).numpy().tobytes()


def test_zero_copy_round_trip(store, host_pool):
    storage = make_storage(store, host_pool, zero_copy=True)
    keys = sglang_page_hashes(list(range(8 * PAGE)), PAGE)  # SGLang's chained page hashes
    assert storage.batch_exists(keys) == 0
    assert storage.batch_set_v1(keys[:6], slots(2, 6)) == [True] * 6
    assert storage.batch_exists(keys) == 6  # a prefix: the first six pages
    assert storage.exists(keys[0]) and not storage.exists(keys[7])
    got = storage.batch_get_v1(keys, slots(20, 8))
    assert got == [True] * 6 + [False] * 2
    assert page_bytes(host_pool, 20, 6) == page_bytes(host_pool, 2, 6)
    storage.close()


def test_legacy_round_trip(store, host_pool):
    storage = make_storage(store, host_pool, zero_copy=False)
    keys = sglang_page_hashes(list(range(1000, 1000 + 4 * PAGE)), PAGE)
    pages = [host_pool.get_data_page(i * PAGE) for i in range(8, 12)]
    assert storage.batch_set(keys, pages)
    assert storage.batch_exists(keys) == 4
    targets = [host_pool.get_dummy_flat_data_page() for _ in keys] + [host_pool.get_dummy_flat_data_page()]
    got = storage.batch_get(keys + [keys[0][::-1]], targets)
    assert got[-1] is None and all(t is not None for t in got[:4])
    for i, page in enumerate(got[:4]):
        host_pool.set_from_flat_data_page((26 + i) * PAGE, page)
    assert page_bytes(host_pool, 26, 4) == page_bytes(host_pool, 8, 4)
    assert storage.get(keys[1], host_pool.get_dummy_flat_data_page()) is not None
    storage.close()


def test_namespaces_keep_ranks_apart(host_pool):
    """MHA pages of TP rank 0 are not TP rank 1's; MLA pages are shared by every rank."""
    from pdsdk.adapters.sglang.hicache import PdsdkHiCacheStorage

    def storage(rank: int, mla: bool) -> PdsdkHiCacheStorage:
        extra = {"store": "memory", "interface_v1": 1}
        s = PdsdkHiCacheStorage(compat.storage_config(extra_config=extra, model_name="tiny", tp_rank=rank, tp_size=2,
                                                      is_mla_model=mla), {})
        s.register_mem_pool_host(host_pool)
        return s

    assert storage(0, False)._prefix != storage(1, False)._prefix
    assert storage(0, True)._prefix == storage(1, True)._prefix
