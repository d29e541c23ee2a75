"""The `lmcache` store beyond the conformance suite: its worker protocol, LMCache's own eviction
and disk tier, and a worker killed mid-run. Store tests start a worker process: slow."""

from __future__ import annotations

import os
import socket
import threading

import msgspec
import pytest
from stores.servers import lmcache_options

from helpers import eventually, read_pages

from pdsdk.connectors.stores.lmcache import worker as lmcache_worker
from pdsdk.connectors.stores.lmcache.store import LMCacheStore, runtime
from pdsdk.errors import MissingDependency


def keys(n, salt):
    return [f"{salt}-{i}".encode().ljust(48, b".") for i in range(n)]


def pages(n, size=4096):
    return [os.urandom(size) for _ in range(n)]




def test_frames_are_msgpack_and_survive_large_bodies():
    a, b = socket.socketpair()
    body = msgspec.msgpack.encode(["put", [b"k" * 48], [os.urandom(3 << 20)]])
    t = threading.Thread(target=lmcache_worker.send_frame, args=(a, body))
    t.start()
    assert bytes(lmcache_worker.recv_frame(b)) == body
    t.join()
    a.close()
    assert lmcache_worker.recv_frame(b) is None  # EOF ends the worker
    b.close()


def test_no_lmcache_anywhere_says_how_to_get_it():
    if runtime("inprocess") is not None:
        pytest.skip("lmcache is importable here")
    with pytest.raises(MissingDependency, match="lmcache"):
        LMCacheStore(mode="inprocess")


@pytest.mark.slow
def test_pressure_evicts_and_never_returns_wrong_bytes(tmp_path):
    with LMCacheStore(**lmcache_options(tmp_path, cpu_bytes=1 << 20)) as s:
        ks, ps = keys(48, "pressure"), pages(48, 64 << 10)  # 3 MiB into a 1 MiB pool
        stored = [s.put([k], [p]) for k, p in zip(ks, ps)]
        assert stored[-1] == 1
        survivors = [i for i, k in enumerate(ks) if s.contains([k])]
        assert 47 in survivors and len(survivors) <= 16
        for i in survivors:
            assert read_pages(s, [ks[i]], 64 << 10) == (1, [ps[i]])


@pytest.mark.slow
def test_disk_tier(tmp_path):
    """LMCache's LocalDiskBackend alone (its CPU tier off): pages go to files and come back exact."""
    opts = lmcache_options(tmp_path, disk_path=str(tmp_path / "lmc"), disk_bytes=64 << 20, config={"local_cpu": False})
    with LMCacheStore(**opts) as s:
        assert "LocalDiskBackend" in s.stats()["backends"]
        ks, ps = keys(6, "disk"), pages(6, 16 << 10)
        assert s.put(ks, ps) == 6
        assert eventually(lambda: s.contains(ks) == 6, 60)  # LMCache writes files asynchronously
        assert read_pages(s, ks, 16 << 10) == (6, ps)
        assert len(os.listdir(tmp_path / "lmc")) >= 6


@pytest.mark.slow
def test_worker_killed_mid_run_misses_then_restarts(tmp_path):
    with LMCacheStore(**lmcache_options(tmp_path, backoff_max_s=0.5)) as s:
        if s.mode != "worker":
            pytest.skip("LMCache runs in process here")
        ks, ps = keys(4, "kill"), pages(4)
        assert s.put(ks, ps) == 4
        os.kill(s.worker_pid, 9)
        # Misses, no exception, an error counted; a new worker starts in the background.
        assert s.contains(ks) == 0
        assert read_pages(s, ks, 4096) == (0, [])
        assert s.put(ks, ps) == 0
        assert s.stats()["errors"] >= 1
        assert s.wait_ready(300)
        assert s.put(ks, ps) == 4  # the new worker's CPU tier starts empty
        assert read_pages(s, ks, 4096) == (4, ps)

