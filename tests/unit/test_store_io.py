"""The store data path (adapters/common/store_io.py) on a host: whole blocks of a paged KV cache into and
out of real stores, bytes checked; loads never wait behind saves; a full path skips saves and counts
them; a store outage during loads costs a recompute, never a stalled step; the scheduler claims a block
only once its save landed."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
from helpers import vllm_request, vllm_scheduler
from stores.servers import redis_server  # noqa: F401 - fixture

from pdsdk.adapters.common import store_io
from pdsdk.adapters.common.store_io import BlockLayout, StoreIO
from pdsdk.adapters.vllm.pages import block_geometry
from pdsdk.connectors.stores.factory import open_store
from pdsdk.connectors.stores.memory import MemoryStore

torch = pytest.importorskip("torch")
BLOCKS = 32


def kv_cache(layers: int = 3, blocks: int = BLOCKS) -> list:
    caches = [torch.empty((2, blocks, 16, 2, 8), dtype=torch.bfloat16) for _ in range(layers)]
    for t in caches:
        t.view(torch.int16).random_()
    return caches


def layout_of(caches: list) -> BlockLayout:
    return BlockLayout([t.data_ptr() for t in caches], [block_geometry(t, BLOCKS) for t in caches], None)


def same_blocks(caches: list, a: list[int], b: list[int]) -> bool:
    bits = [t.view(torch.int16) for t in caches]  # random bits: bf16 NaNs never compare equal
    return all(torch.equal(t[:, a], t[:, b]) for t in bits)


def wait_saved(io) -> object:
    """The vLLM path's stats once a save has landed (its hashes reported for the scheduler)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = io.stats.take()
        if stats is not None and stats.data["store_saved"]:
            return stats
        time.sleep(0.01)
    raise AssertionError("the save did not land")


def save_and_wait(path: StoreIO, blocks: list[int], keys: list[bytes]) -> int:
    landed, stored = threading.Event(), []
    assert path.save(blocks, keys, lambda n: (stored.append(n), landed.set()))
    assert landed.wait(10)
    return stored[0]


@pytest.mark.parametrize("spec", ["memory", "disk", "tiered"])
def test_blocks_round_trip(spec, tmp_path):
    config = {"memory": "memory", "disk": {"name": "disk", "options": {"path": str(tmp_path)}},
              "tiered": {"tiered": [{"name": "memory", "options": {"capacity_bytes": 1}},  # everything demoted
                                    {"name": "disk", "options": {"path": str(tmp_path)}}]}}[spec]
    caches = kv_cache()
    store = open_store(config)
    path = StoreIO(store, layout_of(caches))
    try:
        keys = [b"k%d" % i for i in range(8)]
        assert save_and_wait(path, list(range(8)), keys) == 8
        assert not same_blocks(caches, list(range(8)), list(range(8, 16)))
        assert path.load(list(range(8, 16)), keys).result(10) == 8
        assert same_blocks(caches, list(range(8)), list(range(8, 16)))
        # A missing page ends the prefix: blocks after it are not touched.
        before = [t[:, 20:24].clone() for t in caches]
        assert path.load(list(range(16, 24)), keys[:4] + [b"missing"] + keys[5:]).result(10) == 4
        assert same_blocks(caches, list(range(4)), list(range(16, 20)))
        assert all(torch.equal(t[:, 20:24].view(torch.int16), b.view(torch.int16)) for t, b in zip(caches, before))
    finally:
        path.close()
        store.close()


class SlowCommits(MemoryStore):
    """A memory store whose writes take `delay` seconds each (a slow backend)."""

    delay = 0.3

    def commit(self, reservation, keys, hints=None):
        time.sleep(self.delay)
        return super().commit(reservation, keys, hints)


class HeldCommits(MemoryStore):
    """A memory store whose writes wait until `release` is set (a stuck backend)."""

    def __init__(self, release: threading.Event, **options):
        super().__init__(**options)
        self.release = release

    def commit(self, reservation, keys, hints=None):
        self.release.wait(10)
        return super().commit(reservation, keys, hints)


def test_a_load_never_waits_behind_saves():
    caches = kv_cache()
    store = SlowCommits(capacity_bytes=1 << 26)
    path = StoreIO(store, layout_of(caches))
    try:
        assert save_and_wait(path, [0, 1], [b"a", b"b"]) == 2
        saved = []
        for i in range(8):  # 8 x 0.3 s of saves queued ahead of the load
            assert path.save([2 + i], [b"s%d" % i], saved.append)
        start = time.monotonic()
        assert path.load([20, 21], [b"a", b"b"]).result(10) == 2
        assert time.monotonic() - start < 1.0 and len(saved) < 8, (time.monotonic() - start, saved)
        assert same_blocks(caches, [0, 1], [20, 21])
    finally:
        path.close()


def test_saves_are_skipped_and_counted_when_the_path_is_full(monkeypatch):
    monkeypatch.setattr(store_io, "SAVE_BACKLOG", 2)
    counts: dict[str, int] = {}
    caches = kv_cache()
    release = threading.Event()

    path = StoreIO(HeldCommits(release, capacity_bytes=1 << 26), layout_of(caches),
                   count=lambda **kw: [counts.__setitem__(k, counts.get(k, 0) + v) for k, v in kw.items()])
    try:
        landed = []
        assert path.save([0], [b"a"], landed.append) and path.save([1], [b"b"], landed.append)
        assert not path.save([2, 3], [b"c", b"d"], landed.append)  # two saves in flight: the third is skipped
        assert counts == {"store_saves_skipped": 2}
        release.set()
        deadline = time.monotonic() + 10
        while len(landed) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert landed == [1, 1] and path.save([2], [b"c"], landed.append)  # room again
    finally:
        release.set()
        path.close()


def test_a_store_outage_during_loads_costs_a_recompute_not_a_stall(redis_server, tmp_path):  # noqa: F811
    """redis stopped (SIGSTOP: connections hang, the worst case) while a request loads: every step call
    returns at once, and the load ends as load errors (vLLM recomputes those blocks) within the store's
    timeout."""
    from pdsdk.adapters.vllm.metadata import StorePages
    from pdsdk.adapters.vllm.store_path import StoreIO as VllmStoreIO
    from pdsdk.connectors.stores.common.keys import KeySpace

    from pdsdk.config import load_config

    caches = kv_cache()
    spec = {"name": "redis", "options": {"url": f"redis://127.0.0.1:{redis_server.port}/0", "timeout_s": 1.0}}
    io = VllmStoreIO(load_config({"transport": None, "store": spec}).store,
                     KeySpace(model="m", layout=str(tmp_path), tp_rank=0), caches,
                     [block_geometry(t, BLOCKS) for t in caches])
    hashes = [b"h%d" % i for i in range(4)]
    try:
        io.save([StorePages([0, 1, 2, 3], hashes)])
        wait_saved(io)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            io.start_load("r1", StorePages([10, 11, 12, 13], hashes))
            slowest, done, errors = time.monotonic() - start, set(), set()
            while not done and time.monotonic() - start < 10:
                t = time.monotonic()
                done, errors = io.finished_loads()
                slowest = max(slowest, time.monotonic() - t)
                time.sleep(0.01)
            assert done == {"r1"} and errors == {10, 11, 12, 13}, (done, errors)
            assert slowest < 0.05, f"a step call took {slowest * 1e3:.0f} ms during the outage"
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
    finally:
        io.close()


def test_the_scheduler_claims_a_block_only_once_its_save_landed():
    from pdsdk.adapters.vllm.store_path import StoreIO as VllmStoreIO
    from pdsdk.connectors.stores.common.keys import KeySpace

    caches = kv_cache()
    release = threading.Event()

    side = vllm_scheduler("memory")
    io = VllmStoreIO(HeldCommits(release, capacity_bytes=1 << 26), KeySpace(model="m", layout="l", tp_rank=0), caches,
                     [block_geometry(t, BLOCKS) for t in caches])
    hashes = [b"h%d" % i for i in range(4)] + [b"x"]
    try:
        assert side.get_num_new_matched_tokens(vllm_request("r0", hashes, 5 * 16), 0) == (0, False)
        out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="r0", block_ids=([0, 1, 2, 3, 4],))],
                              scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]),
                              num_scheduled_tokens={"r0": 5 * 16})
        meta = side.build_connector_meta(out)
        assert [(p.block_ids, p.block_hashes) for p in meta.save] == [([0, 1, 2, 3, 4], hashes)]
        io.save(meta.save)  # its store write is held back
        side.update_connector_output(SimpleNamespace(kv_connector_stats=io.stats.take()))
        assert side.get_num_new_matched_tokens(vllm_request("r1", hashes, 5 * 16), 0) == (0, False)
        release.set()
        stats = wait_saved(io)
        side.update_connector_output(SimpleNamespace(kv_connector_stats=stats))
        assert not stats.data["store_saved"]  # taken out before vLLM logs the stats
        assert side.get_num_new_matched_tokens(vllm_request("r2", hashes, 5 * 16), 0) == (4 * 16, True)
        # Scheduled again later (a new request on the same prefix): nothing is saved twice.
        side.get_num_new_matched_tokens(vllm_request("r3", hashes, 5 * 16), 0)
        out.scheduled_new_reqs[0].req_id, out.num_scheduled_tokens = "r3", {"r3": 16}
        assert side.build_connector_meta(out).save == []
    finally:
        release.set()
        io.close()
        side.shutdown()
