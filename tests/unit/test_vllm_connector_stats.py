"""PdsdkConnector's pieces that need vLLM importable but no engine: its connector-stats class (vLLM's
`KVConnectorStats` contract: aggregate, reduce, is_empty, the data round trip), its Prometheus metrics,
and the scheduler's prefix lookups in a shared store (a disk directory another engine filled)."""

from __future__ import annotations

import functools
import time
from types import SimpleNamespace

import pytest
from helpers import vllm_request, vllm_scheduler

pytest.importorskip("vllm")

from pdsdk.adapters.vllm.metadata import PdsdkHandshake
from pdsdk.adapters.vllm.stats import COUNTERS, LATENCIES, SAVED, PdsdkPromMetrics, PdsdkStats, StatsRecorder
from pdsdk.adapters.vllm.store_path import StoreLookup, lookup_only, shared_spec
from pdsdk.config import load_config
from pdsdk.connectors.stores.common.keys import KeySpace
from pdsdk.connectors.stores.factory import open_store

KS = KeySpace(model="/models/tiny", layout="abc123", tp_rank=0, tp_size=1)


def hashes(n: int, salt: bytes = b"") -> list[bytes]:
    return [bytes([i]) * 31 + salt[:1].ljust(1, b"h") for i in range(n)]


# --- stats -----------------------------------------------------------------------------------


def test_stats_aggregate_reduce_and_round_trip():
    from pdsdk.adapters.vllm.connector import PdsdkConnector

    a, b = StatsRecorder(), StatsRecorder()
    assert a.take() is None  # nothing happened: vLLM keeps the step's output empty
    a.add(transfers=1, transfer_bytes=2 << 20, store_hits=3, store_misses=1, store_load_bytes=3 << 20)
    a.time("transfer_seconds", 0.010)
    a.time("store_load_seconds", 0.004)
    b.add(transfers=2, transfer_failures=1, transfer_bytes=4 << 20, store_saves=5, store_save_bytes=5 << 20,
          store_lookups=1, store_lookup_blocks=4)
    b.time("transfer_seconds", 0.020)
    b.time("transfer_seconds", 0.030)
    b.time("store_lookup_seconds", 0.001)
    sa, sb = a.take(), b.take()
    assert a.take() is None  # take() resets
    assert not sa.is_empty() and PdsdkStats().is_empty()
    # vLLM ships to_dict() between processes and rebuilds the object with build_kv_connector_stats.
    rebuilt = PdsdkConnector.build_kv_connector_stats(sb.to_dict())
    total = PdsdkConnector.build_kv_connector_stats(sa.to_dict()).aggregate(rebuilt)
    assert set(total.data) == set(COUNTERS) | set(LATENCIES) | {SAVED}
    assert total.data["transfers"] == 3 and total.data["transfer_failures"] == 1
    assert total.data["transfer_seconds"] == [0.010, 0.020, 0.030]
    r = total.reduce()
    assert r["PD transfers"] == 3 and r["PD failed transfers"] == 1 and r["PD MB"] == 6.0
    assert r["PD avg ms"] == 20.0 and r["PD p90 ms"] == 30.0 and r["PD MB/s"] == 100.0
    assert r["Store hit blocks"] == 3 and r["Store miss blocks"] == 1 and r["Store loaded MB"] == 3.0
    assert r["Store saved blocks"] == 5 and r["Store saved MB"] == 5.0
    assert r["Store lookups"] == 1 and r["Store lookup hit blocks"] == 4
    # An aggregate with an empty one changes nothing; an empty stats object reduces to nothing.
    assert total.aggregate(PdsdkStats()).reduce() == r
    assert PdsdkStats().reduce() == {}
    # Failures alone are not empty (NixlConnector's rule: do not drop failure-only intervals).
    failed = PdsdkStats({"transfer_failures": 1})
    assert not failed.is_empty() and failed.reduce()["PD failed transfers"] == 1


def test_stats_ignore_unknown_keys_and_are_vllm_stats():
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    s = PdsdkStats({"transfers": 1, "from_a_newer_version": 7})
    assert isinstance(s, KVConnectorStats) and "from_a_newer_version" not in s.data
    s.reset()
    assert s.is_empty()


def test_prometheus_metrics_observe():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    if PdsdkPromMetrics is None:
        pytest.skip("this vLLM has no per-connector Prometheus metrics")
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Gauge, Counter, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = PdsdkPromMetrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    data = PdsdkStats({"transfers": 2, "transfer_bytes": 1000, "transfer_seconds": [0.01, 0.02],
                       "store_hits": 4, "store_lookups": 1, "store_lookup_seconds": [0.001]}).to_dict()
    prom.observe(data, 0)
    prom.observe(data, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert reg.get_sample_value("vllm:pdsdk_transfers_total", labels) == 4
    assert reg.get_sample_value("vllm:pdsdk_transfer_bytes_total", labels) == 2000
    assert reg.get_sample_value("vllm:pdsdk_store_hits_total", labels) == 8
    assert reg.get_sample_value("vllm:pdsdk_transfer_seconds_count", labels) == 4
    assert reg.get_sample_value("vllm:pdsdk_store_lookup_seconds_count", labels) == 2


# --- which stores the scheduler asks -----------------------------------------------------------


def spec(store):
    return load_config({"transport": None, "store": store}).store


def test_shared_spec():
    assert shared_spec(None) is None
    assert shared_spec(spec("memory")) is None
    assert shared_spec(spec({"name": "disk", "options": {"path": "/x"}})).name == "disk"
    assert shared_spec(spec({"name": "redis", "options": {"url": "redis://h:1/0"}})).options["url"] == "redis://h:1/0"
    one = shared_spec(spec({"tiered": ["memory", {"name": "disk", "options": {"path": "/x"}}]}))
    assert one.name == "disk" and one.options == {"path": "/x"}
    two = shared_spec(spec({"tiered": ["memory", {"name": "disk", "options": {"path": "/x"}}, "redis"]}))
    assert two.name == "tiered" and [t.name for t in two.tiers] == ["disk", "redis"]
    assert shared_spec(spec({"tiered": ["memory", "memory"]})) is None
    # The scheduler's Mooncake client only asks: it lends the pool no memory.
    mc = lookup_only(shared_spec(spec({"tiered": ["memory", {"name": "mooncake", "options": {"master": "h:1"}}]})))
    assert mc.name == "mooncake" and mc.options == {"master": "h:1", "segment_bytes": 0}
    both = lookup_only(spec({"tiered": ["disk", {"name": "mooncake", "options": {"segment_bytes": 1 << 30}}]}))
    assert both.tiers[0].options == {} and both.tiers[1].options == {"segment_bytes": 0}


# --- lookups -----------------------------------------------------------------------------------


def fill(path, keyspace: KeySpace, page_hashes: list[bytes]) -> None:
    """What another engine's worker does: put pages under its key namespace."""
    with open_store(spec({"name": "disk", "options": {"path": str(path)}})) as store:
        assert store.put(keyspace.keys(page_hashes), [bytes(16)] * len(page_hashes)) == len(page_hashes)


def test_lookup_finds_another_engines_pages(tmp_path):
    h = hashes(6)
    fill(tmp_path, KS, h[:4])
    lookup = StoreLookup(spec({"name": "disk", "options": {"path": str(tmp_path)}}))
    assert lookup.hit_prefix(h) == 0  # no key namespace yet (the handshake has not arrived)
    lookup.set_keyspaces([KS])
    assert lookup.hit_prefix(h) == 4
    assert lookup.hit_prefix(h[1:]) == 3
    assert lookup.hit_prefix(hashes(6, b"x")) == 0
    other = KeySpace(model="/models/tiny", layout="other-layout", tp_rank=0, tp_size=1)
    lookup.set_keyspaces([other])
    assert lookup.hit_prefix(h) == 0  # another KV layout: never a hit
    stats = lookup.stats.take()
    assert stats.data["store_lookups"] == 4 and stats.data["store_lookup_blocks"] == 7
    lookup.close()


def test_lookup_needs_every_tp_rank(tmp_path):
    h = hashes(5)
    ranks = [KeySpace(model="m", layout="l", tp_rank=r, tp_size=2) for r in (0, 1)]
    fill(tmp_path, ranks[0], h[:5])
    fill(tmp_path, ranks[1], h[:2])
    lookup = StoreLookup(spec({"name": "disk", "options": {"path": str(tmp_path)}}))
    lookup.set_keyspaces(ranks)
    assert lookup.hit_prefix(h) == 2
    mla = KeySpace(model="m", layout="l", tp_rank=None, tp_size=2)
    lookup.set_keyspaces([mla, mla])
    assert lookup.keyspaces == [mla]  # MLA: one namespace for every rank, asked once


class Broken:
    name = "broken"

    def __init__(self, delay: float = 0.0, fail: bool = False):
        self.delay, self.fail, self.calls = delay, fail, 0

    def contains(self, keys):
        self.calls += 1
        time.sleep(self.delay)
        if self.fail:
            raise ConnectionError("store down")
        return len(keys)

    def close(self):
        pass


def test_lookup_never_raises_and_pauses_on_trouble(monkeypatch):
    from pdsdk.adapters.vllm import store_path

    monkeypatch.setattr(store_path, "open_store", lambda spec: Broken(fail=True))
    lookup = StoreLookup(spec("redis"))
    lookup.set_keyspaces([KS])
    assert lookup.hit_prefix(hashes(3)) == 0
    assert lookup.hit_prefix(hashes(3)) == 0  # paused: the store is not asked again right away
    assert lookup.store.calls == 1 and lookup.stats.take().data["store_lookup_errors"] == 1

    monkeypatch.setattr(store_path, "open_store", lambda spec: Broken(delay=0.05))
    slow = StoreLookup(spec("redis"), slow_s=0.01)
    slow.set_keyspaces([KS])
    assert slow.hit_prefix(hashes(3)) == 3  # a slow answer is still used, but lookups pause after it
    assert slow.hit_prefix(hashes(3)) == 0 and slow.store.calls == 1

    def cannot_open(spec):
        raise RuntimeError("no such server")

    monkeypatch.setattr(store_path, "open_store", cannot_open)
    closed = StoreLookup(spec("redis"))
    closed.set_keyspaces([KS])
    assert closed.hit_prefix(hashes(3)) == 0


# --- the scheduler half ------------------------------------------------------------------------


def test_scheduler_claims_pages_another_engine_stored(tmp_path):
    h = hashes(8)
    fill(tmp_path, KS, h[:5])
    side = vllm_scheduler({"name": "disk", "options": {"path": str(tmp_path)}})
    try:
        side.set_handshakes({0: PdsdkHandshake(tp_rank=0, descriptor=b"", geometry=[],
                                               store_keyspace={"model": KS.model, "layout": KS.layout,
                                                               "tp_rank": 0, "tp_size": 1})})
        assert not side.side_channel.entries  # no transport: nothing to serve to PD peers
        # 8 blocks of 16 tokens: the last block is never claimed (vLLM computes at least one token).
        assert side.get_num_new_matched_tokens(vllm_request("r1", h, 8 * 16), 0) == (5 * 16, True)
        assert side.get_num_new_matched_tokens(vllm_request("r1", h, 8 * 16), 0) == (5 * 16, True)
        assert side.stats.take().data["store_lookups"] == 1  # asked again while waiting: memoised
        # This engine's own saves are found in its index first; the store is asked for the rest only.
        side.store_index.add(h[:2])
        assert side.get_num_new_matched_tokens(vllm_request("r2", h, 8 * 16), 0) == (5 * 16, True)
        assert side.stats.take().data["store_lookup_blocks"] == 3
        assert side.get_num_new_matched_tokens(vllm_request("r3", hashes(4, b"z"), 4 * 16), 0) == (0, False)
        # A memory store is process-local: the scheduler only has its own index.
        local = vllm_scheduler("memory")
        assert local.store_lookup is None
        local.shutdown()
    finally:
        side.shutdown()
