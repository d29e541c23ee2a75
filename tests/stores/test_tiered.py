"""Tiered composition: puts to the first tier, evictions demote, reads promote, prefix across tiers."""

from __future__ import annotations

import os

from pdsdk.connectors.stores.factory import open_store

PAGE = 4096


def keys(n, salt):
    return [f"{salt}-{i}".encode().ljust(32, b".") for i in range(n)]


def read(store, ks):
    out = [bytearray(PAGE) for _ in ks]
    hits = store.get(ks, out)
    return hits, [bytes(o) for o in out[:hits]]


def make(tmp_path, memory_pages=4):
    return open_store({"tiered": [{"name": "memory", "options": {"capacity_bytes": memory_pages * PAGE}},
                                  {"name": "disk", "options": {"path": str(tmp_path)}}]})


def test_config_shorthand_builds_the_tiers(tmp_path):
    s = make(tmp_path)
    assert [t.name for t in s.tiers] == ["memory", "disk"]
    s.close()


def test_evictions_demote_and_reads_promote(tmp_path):
    s = make(tmp_path)
    memory, disk = s.tiers
    ks, ps = keys(8, "t"), [os.urandom(PAGE) for _ in range(8)]
    for i in range(8):
        assert s.put(ks[i:i + 1], ps[i:i + 1]) == 1
    assert memory.contains(ks) == 0 and memory.contains(ks[4:]) == 4  # the first four went down
    assert disk.contains(ks[:4]) == 4
    assert s.contains(ks) == 8  # the prefix runs across tiers
    assert read(s, ks) == (8, ps)
    # Read back up: 0-3 were promoted, then pushed down again by 4-7; the lower tier is inclusive.
    assert memory.contains(ks[4:]) == 4 and disk.contains(ks) == 8
    memory.delete(ks)
    assert read(s, ks[:2]) == (2, ps[:2]) and memory.contains(ks[:2]) == 2  # promotion
    assert s.stats()["hits"] == 10 and len(s.stats()["tiers"]) == 2
    s.close()


def test_a_batch_larger_than_the_first_tier_spills_to_the_next(tmp_path):
    s = make(tmp_path)
    ks, ps = keys(8, "big"), [os.urandom(PAGE) for _ in range(8)]
    assert s.put(ks, ps) == 8
    assert s.tiers[0].contains(ks) == 4 and s.tiers[1].contains(ks[4:]) == 4
    assert read(s, ks) == (8, ps)
    s.close()


def test_prefix_alternating_between_tiers(tmp_path):
    s = make(tmp_path, memory_pages=16)
    memory, disk = s.tiers
    ks, ps = keys(6, "alt"), [os.urandom(PAGE) for _ in range(6)]
    for i in range(6):
        (memory if i % 2 == 0 else disk).put([ks[i]], [ps[i]])
    assert s.contains(ks) == 6
    assert read(s, ks) == (6, ps)
    disk.delete([ks[3]])
    memory.delete([ks[3]])
    assert s.contains(ks) == 3
    assert s.delete(ks) == 5
    s.close()


def test_demoted_pages_keep_their_hints(tmp_path):
    from pdsdk.connectors.stores.base import Hints

    s = make(tmp_path, memory_pages=2)
    low = keys(2, "low")
    s.put(low, [os.urandom(PAGE) for _ in low], Hints(priority=-3))
    s.put(keys(2, "new"), [os.urandom(PAGE) for _ in range(2)])
    disk = s.tiers[1]
    assert disk.contains(low) == 2
    assert disk._eviction._entries[low[0]].rank == (True, -3)
    s.close()
