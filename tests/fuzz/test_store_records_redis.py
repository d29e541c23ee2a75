"""Fuzz: random damage to the values a redis store wrote, through redis itself. Every get answers
the exact bytes that were put or a miss; after a get, contains agrees with it; nothing raises."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stores.servers import redis_server  # noqa: F401 - fixture

pytestmark = pytest.mark.slow  # a real redis-server

KINDS = ("flip", "setrange", "truncate", "append", "random value", "other page", "list", "hash", "empty")
DAMAGE = st.tuples(st.sampled_from(KINDS), st.integers(0, 7), st.floats(0, 1), st.integers(1, 64))


def _damage(client, name: bytes, other: bytes, kind: str, where: float, n: int, rng: random.Random) -> None:
    if client.type(name) not in (b"string", b"none"):  # an earlier damage made it a list or hash
        client.delete(name)
    value = client.get(name) or b""
    at = min(int(where * len(value)), max(len(value) - 1, 0))
    if kind == "flip" and value:
        client.setrange(name, at, bytes([value[at] ^ (1 << rng.randrange(8))]))
    elif kind == "setrange":
        client.setrange(name, at, rng.randbytes(n))
    elif kind == "truncate":
        client.set(name, value[:at])
    elif kind == "append":
        client.append(name, rng.randbytes(n))
    elif kind == "random value":
        client.set(name, rng.randbytes(n * 100))
    elif kind == "other page":
        client.copy(other, name, replace=True)
    elif kind in ("list", "hash"):
        client.delete(name)
        client.rpush(name, b"x") if kind == "list" else client.hset(name, "f", b"x")
    else:
        client.set(name, b"")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=st.lists(DAMAGE, min_size=1, max_size=4), seed=st.integers(0, 1 << 16))
def test_value_damage(redis_server, damage, seed):  # noqa: F811 - fixture
    from pdsdk.connectors.stores.redis import RedisStore

    rng = random.Random(seed)
    store = RedisStore(url=f"redis://127.0.0.1:{redis_server.port}/0", prefix=f"f{os.urandom(4).hex()}:")
    try:
        keys = [rng.randbytes(32) for _ in range(8)]
        pages = {k: rng.randbytes(rng.choice([4096, 70_000])) for k in keys}
        assert store.put(keys, list(pages.values())) == len(keys)
        for kind, pick, where, n in damage:
            _damage(store._client, store._key(keys[pick]), store._key(keys[(pick + 1) % 8]), kind, where, n, rng)
        for key, page in pages.items():
            out = bytearray(len(page))
            hit = store.get([key], [out])
            if hit:
                assert bytes(out) == page, "wrong bytes"
            assert store.contains([key]) == hit
        assert store.put(keys, list(pages.values())) == len(keys)
        assert all(store.get([k], [bytearray(len(p))]) == 1 for k, p in pages.items())
    finally:
        store._client.delete(*[store._key(k) for k in pages])
        store.close()
