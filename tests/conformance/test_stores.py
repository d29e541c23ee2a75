"""The L3 store contract, run against every registered store."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest
from helpers import need_plugin

from pdsdk.plugins import registry

# Options a store needs to run in tests (servers, paths); anything else is built with no options.
STORE_OPTIONS: dict[str, object] = {}


@pytest.fixture
def store(store_name, tmp_path):
    spec = registry().get("store", store_name)
    need_plugin(spec)
    make_options = STORE_OPTIONS.get(store_name, lambda tmp: {})
    s = spec.load()(name=store_name, **make_options(tmp_path))
    yield s
    s.close()
    s.close()  # a second close does nothing


def keys(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() for i in range(n)]


def pages(n: int, size: int = 4096) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


def test_round_trip_is_bit_exact(store):
    ks, ps = keys(8, "rt"), pages(8)
    assert store.put(ks, ps) == 8
    out = [bytearray(4096) for _ in ks]
    assert store.get(ks, out) == 8
    assert [bytes(o) for o in out] == ps


def test_contains_and_get_answer_the_hit_prefix(store):
    ks = keys(6, "prefix")
    store.put(ks[:3] + ks[4:], pages(5))
    assert store.contains(ks) == 3
    assert store.contains(ks[:2]) == 2
    assert store.contains(keys(2, "absent")) == 0
    out = [bytearray(4096) for _ in ks]
    assert store.get(ks, out) == 3


def test_delete(store):
    ks = keys(4, "del")
    store.put(ks, pages(4))
    assert store.delete(ks[:2] + keys(1, "never")) == 2
    assert store.contains(ks) == 0
    assert store.contains(ks[2:]) == 2


def test_threads(store):
    errors = []

    def worker(t: int) -> None:
        try:
            ks, ps = keys(16, f"thread{t}"), pages(16, 1024)
            store.put(ks, ps)
            out = [bytearray(1024) for _ in ks]
            hits = store.get(ks, out)
            assert [bytes(o) for o in out[:hits]] == ps[:hits]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


def test_stats_count_hits_and_misses(store):
    ks = keys(3, "stats")
    store.put(ks[:2], pages(2))
    store.get(ks, [bytearray(4096) for _ in ks])
    stats = store.stats()
    assert stats["store"] == store.name
    assert stats["hits"] >= 2 and stats["misses"] >= 1
