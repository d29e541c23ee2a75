"""Redis and Mooncake values that are not what the store wrote: a miss, deleted, an error counted;
`contains` and `get` agree; never wrong bytes. Values are damaged through the servers' own clients."""

from __future__ import annotations

import os

import numpy as np
import pytest
from stores.servers import mooncake_master, mooncake_options, redis_server  # noqa: F401 - fixtures

from helpers import read_pages

PAGE = 4096
pytestmark = pytest.mark.slow  # real servers


def keys(n, salt):
    return [f"{salt}-{i}".encode().ljust(32, b".") for i in range(n)]


@pytest.fixture
def redis_store(redis_server):  # noqa: F811 - fixture
    from pdsdk.connectors.stores.redis import RedisStore

    s = RedisStore(url=f"redis://127.0.0.1:{redis_server.port}/0", prefix=f"t{os.urandom(4).hex()}:")
    yield s
    s.close()


def _stored(s, ks):
    ps = [os.urandom(PAGE) for _ in ks]
    assert s.put(ks, ps) == len(ks)
    return ps


REDIS_DAMAGE = {
    "short value": lambda r, k, v: r.set(k, v[: len(v) // 2]),  # the rest of the buffer would be stale
    "raw page, no header": lambda r, k, v: r.set(k, os.urandom(PAGE)),
    "one flipped byte": lambda r, k, v: r.setrange(k, len(v) - 7, bytes([v[-7] ^ 1])),
    "flipped length": lambda r, k, v: r.setrange(k, 8, bytes([v[8] ^ 1])),
    "longer value": lambda r, k, v: r.append(k, b"x"),
    "a list": lambda r, k, v: (r.delete(k), r.rpush(k, b"a", b"b")),
    "a hash": lambda r, k, v: (r.delete(k), r.hset(k, "f", v)),
}


@pytest.mark.parametrize("kind", sorted(REDIS_DAMAGE))
def test_redis_bad_value_is_a_miss_deleted_and_counted(redis_store, kind):
    s, client = redis_store, redis_store._client
    ks = keys(3, "bad")
    ps = _stored(s, ks)
    name = s._key(ks[1])
    REDIS_DAMAGE[kind](client, name, client.get(name))
    # contains and get agree, except on payload damage, which only get reads
    assert s.contains(ks) == (3 if kind == "one flipped byte" else 1)
    errors = s.stats()["errors"]
    assert read_pages(s, ks, PAGE) == (1, ps[:1])
    assert s.stats()["errors"] == errors + 1
    assert client.exists(name) == 0  # deleted
    assert s.contains(ks) == 1
    assert s.put(ks, ps) == 3 and read_pages(s, ks, PAGE) == (3, ps)


def test_redis_value_from_another_key_fails_its_checksum(redis_store):
    s, client = redis_store, redis_store._client
    ks = keys(2, "moved")
    ps = _stored(s, ks)
    client.set(s._key(ks[1]), client.get(s._key(ks[0])))  # a well-formed record, of another page
    assert read_pages(s, ks, PAGE) == (1, ps[:1])


def test_redis_page_of_another_size_is_bad_and_not_fetched_whole(redis_store):
    s = redis_store
    ks = keys(1, "big")
    s.put(ks, [os.urandom(64 * PAGE)])
    assert read_pages(s, ks, PAGE) == (0, []) and s.stats()["errors"] == 1
    assert s.stats()["bytes_out"] == 0 and s.contains(ks) == 0  # deleted: a key space has one page size


@pytest.fixture
def mooncake_store(mooncake_master):  # noqa: F811 - fixture
    from pdsdk.connectors.stores.mooncake import MooncakeStore

    s = MooncakeStore(**mooncake_options(mooncake_master))
    yield s
    s.close()


def _raw_put(s, key, data: bytes) -> None:
    """Replace the object under `key` with `data`, through the Mooncake client."""
    name = s._key(key)
    s._client.batch_remove([name], True)
    buf = np.frombuffer(data, np.uint8)
    assert s._client.batch_put_from([name], [buf.ctypes.data], [len(data)]) == [0]


def _mooncake_object(s, key, size) -> bytes:
    buf = np.zeros(size, np.uint8)
    assert s._client.batch_get_into([s._key(key)], [buf.ctypes.data], [size]) == [size]
    return buf.tobytes()


MOONCAKE_DAMAGE = {
    "one flipped byte": lambda v: v[:-7] + bytes([v[-7] ^ 1]) + v[-6:],
    "flipped header": lambda v: v[:20] + bytes([v[20] ^ 1]) + v[21:],
    "short object": lambda v: v[: len(v) // 2],
    "raw page, no header": lambda v: os.urandom(PAGE),
    "longer object": lambda v: v + b"x",
}


@pytest.mark.parametrize("kind", sorted(MOONCAKE_DAMAGE))
def test_mooncake_bad_object_is_a_miss_deleted_and_counted(mooncake_store, kind):
    from pdsdk.connectors.stores.common.remote_record import HEADER_SIZE

    s = mooncake_store
    ks = keys(3, f"bad-{kind}")
    ps = _stored(s, ks)
    _raw_put(s, ks[1], MOONCAKE_DAMAGE[kind](_mooncake_object(s, ks[1], HEADER_SIZE + PAGE)))
    errors = s.stats()["errors"]
    assert read_pages(s, ks, PAGE) == (1, ps[:1])
    assert s.stats()["errors"] > errors
    assert s.contains(ks[1:2]) == 0  # deleted, so contains agrees
    assert s.put(ks, ps) == 3 and read_pages(s, ks, PAGE) == (3, ps)
