"""The L3 store contract, run against every registered store.

Stores are found through the registry at collection time, so a third-party store is picked up
with no change here. Stores that need a server or options get them from STORE_OPTIONS (servers
start once per session, on free loopback ports); stores that evict by themselves are bounded
through BOUNDED for the capacity and eviction-order tests.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid

import numpy as np
import pytest
from helpers import need_plugin
from stores.servers import lmcache_options, mooncake_options
from stores.servers import mooncake_master, redis_server  # noqa: F401 - fixtures

from pdsdk.connectors.stores.base import Hints
from pdsdk.plugins import plugin_manager, registry


def _tiers(tmp, memory_bytes=64 << 20, disk_bytes=256 << 20):
    return {"tiers": [{"name": "memory", "options": {"capacity_bytes": memory_bytes}},
                      {"name": "disk", "options": {"path": str(tmp / "tier-disk"), "capacity_bytes": disk_bytes}}]}


# name -> function(tmp_path, fixture) -> options; `fixture(name)` starts a session server on demand.
STORE_OPTIONS = {
    "disk": lambda tmp, fx: {"path": str(tmp / "disk")},
    "tiered": lambda tmp, fx: _tiers(tmp),
    "redis": lambda tmp, fx: {"url": f"redis://127.0.0.1:{fx('redis_server').port}/0",
                              "prefix": f"t{uuid.uuid4().hex[:8]}:", "backoff_max_s": 0.5},
    "mooncake": lambda tmp, fx: mooncake_options(fx("mooncake_master")),
    "lmcache": lambda tmp, fx: lmcache_options(tmp),
}
# Stores whose tests start a server or a worker process: the full suite only.
SERVER_STORES = {"redis", "mooncake", "lmcache"}
# Stores that evict by themselves: name -> function(tmp_path, capacity_bytes) -> options.
BOUNDED = {
    "memory": lambda tmp, n: {"capacity_bytes": n},
    "disk": lambda tmp, n: {"path": str(tmp / "bounded"), "capacity_bytes": n},
}
PAGE = 4096
SLACK = 256  # per-page bookkeeping a store may count against its capacity (disk: header + key)


def _case(name):
    return pytest.param(name, id=name, marks=pytest.mark.slow if name in SERVER_STORES else ())


# Named store_case, not store_name: conftest parametrizes store_name, without slow marks.
@pytest.fixture(params=[_case(n) for n in registry().names("store")])
def store_case(request):
    return request.param


def _open(name, options):
    spec = registry().get("store", name)
    need_plugin(spec)
    return spec.load()(name=name, **options)


@pytest.fixture
def store(store_case, tmp_path, request):
    make_options = STORE_OPTIONS.get(store_case, lambda tmp, fx: {})
    s = _open(store_case, make_options(tmp_path, request.getfixturevalue))
    yield s
    s.close()
    s.close()  # a second close does nothing


@pytest.fixture(params=sorted(BOUNDED))
def bounded(request, tmp_path):
    """(factory(capacity_pages) -> store) for stores that evict by themselves."""
    opened = []

    def make(pages: int):
        s = _open(request.param, BOUNDED[request.param](tmp_path, pages * (PAGE + SLACK)))
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


def keys(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() for i in range(n)]


def pages(n: int, size: int = PAGE) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


def read(store, ks, size=PAGE):
    out = [bytearray(size) for _ in ks]
    hits = store.get(ks, out)
    return hits, [bytes(o) for o in out[:hits]]


def test_round_trip_is_bit_exact(store):
    ks, ps = keys(8, "rt"), pages(8)
    assert store.put(ks, ps) == 8
    out = [bytearray(PAGE) for _ in ks]
    assert store.get(ks, out) == 8
    assert [bytes(o) for o in out] == ps


def test_any_buffer_type_in_and_out(store):
    """bytes, bytearray, memoryview and numpy arrays of any dtype (CPU tensors: pass .numpy())."""
    ks = keys(4, "types")
    src = [os.urandom(PAGE), bytearray(os.urandom(PAGE)), memoryview(os.urandom(PAGE)),
           np.frombuffer(os.urandom(PAGE), np.float16)]
    assert store.put(ks, src) == 4
    out = [np.zeros(PAGE, np.uint8), np.zeros(PAGE // 4, np.float32), bytearray(PAGE), memoryview(bytearray(PAGE))]
    assert store.get(ks, out) == 4
    assert [np.asarray(o).tobytes() if isinstance(o, np.ndarray) else bytes(o) for o in out] == \
        [bytes(src[0]), bytes(src[1]), bytes(src[2]), src[3].tobytes()]


def test_contains_and_get_answer_the_hit_prefix(store):
    ks = keys(6, "prefix")
    store.put(ks[:3] + ks[4:], pages(5))
    assert store.contains(ks) == 3
    assert store.contains(ks[:2]) == 2
    assert store.contains(keys(2, "absent")) == 0
    assert store.contains([]) == 0
    out = [bytearray(PAGE) for _ in ks]
    assert store.get(ks, out) == 3
    assert store.get([], []) == 0


def test_batch_of_many_pages(store):
    ks, ps = keys(64, "batch"), pages(64, 16 << 10)
    assert store.put(ks, ps) == 64
    assert store.contains(ks) == 64
    assert read(store, ks, 16 << 10) == (64, ps)


def test_put_of_a_stored_key_counts_as_stored(store):
    ks, ps = keys(2, "again"), pages(2)
    assert store.put(ks, ps) == 2
    assert store.put(ks, ps) == 2
    assert read(store, ks) == (2, ps)


def test_delete(store):
    ks = keys(4, "del")
    store.put(ks, pages(4))
    assert store.delete(ks[:2] + keys(1, "never")) == 2
    assert store.contains(ks) == 0
    assert store.contains(ks[2:]) == 2


def test_threads(store):
    errors = []
    shared, shared_pages = keys(8, "shared"), pages(8, 1024)

    def worker(t: int) -> None:
        try:
            ks, ps = keys(16, f"thread{t}"), pages(16, 1024)
            for _ in range(3):
                store.put(ks, ps)
                store.put(shared, shared_pages)
                hits, got = read(store, ks, 1024)
                assert got == ps[:hits]
                hits, got = read(store, shared, 1024)
                assert got == shared_pages[:hits]
                store.contains(ks)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


class _Observer:
    def __init__(self):
        self.hits = self.misses = 0

    from pdsdk.hookspecs import hookimpl

    @hookimpl
    def pdsdk_store_hit(self, store, pages, nbytes):
        self.hits += pages

    @hookimpl
    def pdsdk_store_miss(self, store, pages):
        self.misses += pages


def test_stats_and_hooks_count_hits_and_misses(store):
    observer = _Observer()
    plugin_manager().register(observer)
    try:
        ks = keys(3, "stats")
        store.put(ks[:2], pages(2))
        store.get(ks, [bytearray(PAGE) for _ in ks])
    finally:
        plugin_manager().unregister(observer)
    stats = store.stats()
    assert stats["store"] == store.name
    assert stats["hits"] >= 2 and stats["misses"] >= 1
    assert stats["puts"] >= 2 and stats["bytes_out"] >= 2 * PAGE
    assert observer.hits >= 2 and observer.misses >= 1


# -- capacity pressure and eviction order (stores that evict by themselves) ------------------------
def test_pressure_keeps_within_capacity_and_never_returns_wrong_bytes(bounded):
    s = bounded(8)
    ks, ps = keys(40, "pressure"), pages(40)
    for k, p in zip(ks, ps):
        assert s.put([k], [p]) == 1
    survivors = [i for i, k in enumerate(ks) if s.contains([k])]
    assert 4 <= len(survivors) <= 8
    assert survivors[-1] == 39  # the newest page is there
    for i in survivors:
        assert read(s, [ks[i]]) == (1, [ps[i]])
    assert s.stats()["evictions"] >= 32


def test_lru_without_hints(bounded):
    s = bounded(4)
    ks = keys(5, "lru")
    s.put(ks[:4], pages(4))
    read(s, [ks[0]])  # page 0 is now the most recently used
    s.put([ks[4]], pages(1))
    assert s.contains([ks[1]]) == 0
    assert s.contains([ks[0]]) == 1 and s.contains(ks[2:]) == 3


def test_low_priority_and_unkept_pages_go_first(bounded):
    s = bounded(6)
    low, unkept, normal = keys(2, "low"), keys(2, "unkept"), keys(2, "normal")
    s.put(normal, pages(2))
    s.put(low, pages(2), Hints(priority=-1))
    s.put(unkept, pages(2), Hints(keep=False, priority=5))
    s.put(keys(2, "new"), pages(2))
    assert s.contains(unkept[:1]) == 0 and s.contains(unkept[1:]) == 0  # keep=False first
    s.put(keys(2, "newer"), pages(2))
    assert s.contains(low[:1]) == 0 and s.contains(low[1:]) == 0  # then low priority
    assert s.contains(normal) == 2


def test_pinned_pages_survive_pressure_until_their_ttl(bounded):
    s = bounded(4)
    pinned, forever = keys(2, "pinned"), keys(1, "forever")
    pinned_pages = pages(2)
    s.put(pinned, pinned_pages, Hints(pin=True, ttl_s=0.5))
    s.put(forever, pages(1), Hints(pin=True))
    for i in range(10):
        s.put(keys(1, f"churn{i}"), pages(1))
    assert read(s, pinned) == (2, pinned_pages)
    assert s.contains(forever) == 1
    # Only one page is not pinned: a batch of two stores one, never evicting a pinned page.
    assert s.put(keys(2, "full"), pages(2)) == 1
    time.sleep(0.6)
    assert s.contains(pinned[:1]) == 0  # lifetime over
    assert s.put(keys(2, "after"), pages(2)) == 2
    assert s.contains(forever) == 1


def test_ttl_expires_pages(bounded):
    s = bounded(4)
    ks = keys(1, "ttl")
    s.put(ks, pages(1), Hints(ttl_s=0.2))
    assert s.contains(ks) == 1
    time.sleep(0.3)
    assert s.contains(ks) == 0
    assert read(s, ks)[0] == 0
