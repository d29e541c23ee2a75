"""Backends failing under the stores: they answer misses and log, never raise, never lie.

The disk store's damage, crash and full-filesystem tests are in test_disk.py."""

from __future__ import annotations

import os
import time

import pytest
from stores.servers import mooncake_options, start_mooncake_master, start_redis

from pdsdk.ports import free_port

from helpers import eventually, read_pages

PAGE = 4096


def pages(n, size=PAGE):
    return [os.urandom(size) for _ in range(n)]


def keys(n, salt):
    return [f"{salt}-{i}".encode().ljust(32, b".") for i in range(n)]


# -- redis --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_redis_killed_then_restarted(tmp_path):
    from pdsdk.connectors.stores.redis import RedisStore

    server = start_redis(tmp_path)
    try:
        s = RedisStore(url=f"redis://127.0.0.1:{server.port}/0", timeout_s=0.5, backoff_max_s=0.5)
        ks, ps = keys(4, "kill"), pages(4)
        assert s.put(ks, ps) == 4
        server.kill()
        for _ in range(5):  # misses, nothing raised, and quickly once the store knows
            assert read_pages(s, ks, PAGE) == (0, [])
            assert s.put(ks, ps) == 0 and s.contains(ks) == 0 and s.delete(ks) == 0
        t = time.monotonic()
        read_pages(s, ks, PAGE)
        assert time.monotonic() - t < 0.6
        assert s.stats()["errors"] >= 1 and s.stats()["reachable"] is False
        server.start()  # same port, empty (no persistence)
        assert eventually(lambda: s.put(ks, ps) == 4)
        assert read_pages(s, ks, PAGE) == (4, ps)
        s.close()
    finally:
        server.stop()


@pytest.mark.slow
def test_redis_unreachable_from_the_start():
    from pdsdk.connectors.stores.redis import RedisStore

    s = RedisStore(url=f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    assert s.put(keys(1, "x"), pages(1)) == 0
    assert read_pages(s, keys(1, "x"), PAGE) == (0, [])
    assert s.stats()["errors"] == 1  # later calls wait for the backoff instead of failing again
    s.close()


@pytest.mark.slow
def test_redis_pressure_keeps_pinned_pages(tmp_path):
    """The server evicts (volatile-lru, 4 MB): unpinned pages go, pinned ones stay, bytes stay exact."""
    from pdsdk.connectors.stores.base import Hints
    from pdsdk.connectors.stores.redis import RedisStore

    server = start_redis(tmp_path, maxmemory="4mb")
    try:
        s = RedisStore(url=f"redis://127.0.0.1:{server.port}/0")
        pinned, pinned_pages = keys(8, "pin"), pages(8, 64 << 10)
        assert s.put(pinned, pinned_pages, Hints(pin=True)) == 8
        ks, ps = keys(200, "churn"), pages(200, 64 << 10)  # 12.5 MiB through 4 MiB
        for i in range(0, 200, 10):
            s.put(ks[i:i + 10], ps[i:i + 10])
        assert read_pages(s, pinned, 64 << 10) == (8, pinned_pages)
        assert s.stats()["server_evicted_keys"] > 0
        for i, k in enumerate(ks):
            hits, got = read_pages(s, [k], 64 << 10)
            assert got == ps[i:i + 1][:hits]
        s.close()
    finally:
        server.stop()


# -- mooncake -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_mooncake_master_down(tmp_path):
    from pdsdk.connectors.stores.mooncake import MooncakeStore

    master = start_mooncake_master(tmp_path)
    try:
        s = MooncakeStore(**mooncake_options(master))
        ks, ps = keys(4, "mc"), pages(4)
        assert s.put(ks, ps) == 4 and read_pages(s, ks, PAGE) == (4, ps)
        master.kill()
        read_pages(s, ks, PAGE)  # the first call after the crash may wait out the RPC timeout
        assert eventually(lambda: not s.stats()["reachable"], 15)
        t = time.monotonic()
        for _ in range(3):
            assert read_pages(s, ks, PAGE) == (0, []) and s.put(ks, ps) == 0 and s.contains(ks) == 0
        assert time.monotonic() - t < 0.5  # answered locally while the master is down
        assert s.stats()["errors"] >= 1
        s.close()
    finally:
        master.stop()


@pytest.mark.slow
def test_mooncake_master_unreachable_at_start():
    from pdsdk.connectors.stores.mooncake import MooncakeStore

    t = time.monotonic()
    s = MooncakeStore(master=f"127.0.0.1:{free_port()}", segment_bytes=16 << 20, buffer_bytes=16 << 20,
                      connect_timeout_s=1)
    assert read_pages(s, keys(1, "x"), PAGE) == (0, []) and s.put(keys(1, "x"), pages(1)) == 0
    assert time.monotonic() - t < 3  # setup goes on in the background
    s.close()


@pytest.mark.slow
def test_mooncake_delete_right_after_get_despite_lease(mooncake_master):  # noqa: F811 - fixture
    from pdsdk.connectors.stores.mooncake import MooncakeStore

    s = MooncakeStore(**mooncake_options(mooncake_master))
    ks, ps = keys(3, "lease"), pages(3)
    s.put(ks, ps)
    assert read_pages(s, ks, PAGE) == (3, ps)  # takes a lease on every page
    assert s.delete(ks) == 3
    assert s.contains(ks) == 0
    s.close()


from stores.servers import mooncake_master  # noqa: E402,F401 - fixture

