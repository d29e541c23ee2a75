"""Session fixtures with real servers on free loopback ports (pdsdk.testing.servers).

Import the fixtures into a test module (`from stores.servers import redis_server`) to use them."""

from __future__ import annotations

import os
import time

import pytest

from pdsdk.testing import servers
from pdsdk.testing.servers import Server


def start_redis(workdir, maxmemory="64mb") -> Server:
    try:
        return servers.start_redis(workdir, maxmemory)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def start_mooncake_master(workdir) -> Server:
    try:
        return servers.start_mooncake_master(workdir)
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    server = start_mooncake_master(tmp_path_factory.mktemp("mooncake"))
    yield server
    server.stop()


def mooncake_options(master: Server) -> dict:
    # A small segment: every test store contributes it to the pool.
    return {"master": f"127.0.0.1:{master.port}", "segment_bytes": 32 << 20, "buffer_bytes": 16 << 20,
            "probe_s": 0.2, "prefix": f"t{os.getpid()}-{time.monotonic_ns()}/"}


def lmcache_options(tmp, **extra) -> dict:
    """Options for an `lmcache` store in a test, or skip (fail in `make test`) when LMCache is
    nowhere: neither importable here nor in a side venv (`make .venv/.lmcache` builds one)."""
    from helpers import REQUIRE_ALL

    from pdsdk.connectors.stores.lmcache.store import runtime

    if runtime() is None:
        (pytest.fail if REQUIRE_ALL else pytest.skip)("lmcache: not importable here and no LMCache venv")
    # A small CPU pool: each test store is its own LMCache instance (a worker process here).
    return {"cpu_bytes": 32 << 20, "start_timeout_s": 300, **extra}
