"""KV event streams over ZMQ (replay on start and on gaps, lossy fallback, engine restart,
AllBlocksCleared) and the kv_events policy routing on them through the router."""

from __future__ import annotations

import asyncio
import time

import pytest
from kvevents import BS, publish, wait
from pdsdk.router.kvindex import KVIndex
from pdsdk.router.kvindex.stream import EventStream
from pdsdk.testing import fake_kv_events as fe
from pdsdk.testing.router_harness import Decisions, Harness


def test_stream_replays_history_on_start_and_fills_gaps(stream_env):
    pub, ep = stream_env()
    publish(pub, "vllm", list(range(100, 108)))  # before the router connects
    idx = KVIndex()
    s = EventStream("w", ep[0], idx, ep[1])
    s.start()
    try:
        assert s.ready.wait(5) and idx.lookup(list(range(100, 108))) == {"w": 8}
        probe = list(range(200, 208))
        while idx.lookup(probe) != {"w": 8}:  # until the subscription is live (ZMQ slow joiner)
            publish(pub, "vllm", probe)
            time.sleep(0.02)
        pub.drop_next(2)  # lost on the way: the next message reveals the gap
        for i in range(3):
            publish(pub, "vllm", list(range(i * 8, i * 8 + 8)))
        assert wait(lambda: all(idx.lookup(list(range(i * 8, i * 8 + 8))) == {"w": 8} for i in range(3)))
        assert s.counts["gaps"] >= 1 and s.state == "exact" and s.last == pub.seq - 1
    finally:
        s.stop()
        s.join(2)


def test_a_stream_whose_replay_is_empty_is_exact_at_once(stream_env):
    """An engine that has stored nothing yet: after the (empty) replay the index holds all it has."""
    pub, ep = stream_env()
    s = EventStream("w", ep[0], KVIndex(), ep[1])
    s.start()
    try:
        assert s.ready.wait(5) and s.state == "exact" and s.last is None
    finally:
        s.stop()
        s.join(2)


def test_stream_without_replay_goes_lossy_on_a_gap(stream_env):
    pub, ep = stream_env(replay=False)
    idx = KVIndex()
    s = EventStream("w", ep[0], idx, None)
    s.start()
    try:
        s.ready.wait(5)
        old = list(range(8))
        while idx.lookup(old) != {"w": 8}:  # until the subscription is live (ZMQ slow joiner)
            publish(pub, "vllm", old)
            time.sleep(0.02)
        pub.drop_next(1)  # maybe a removal of `old` was in there: the index must forget
        publish(pub, "vllm", [1] * 8)
        publish(pub, "vllm", [2] * 8)
        assert wait(lambda: s.state == "lossy")
        assert idx.lookup(old) == {} and wait(lambda: idx.lookup([2] * 8) == {"w": 8})
    finally:
        s.stop()
        s.join(2)


def test_engine_restart_resyncs(stream_env):
    pub, ep = stream_env()
    idx = KVIndex()
    s = EventStream("w", ep[0], idx, ep[1])
    s.start()
    try:
        s.ready.wait(5)
        for i in range(5):
            publish(pub, "vllm", [i] * 8)
        assert wait(lambda: idx.lookup([4] * 8) == {"w": 8})
        pub.close()  # the engine dies; a new one starts on the same ports with an empty cache
        time.sleep(0.1)
        pub2, _ = stream_env(ep=ep)
        publish(pub2, "vllm", [9] * 8)
        publish(pub2, "vllm", [8] * 8)
        assert wait(lambda: idx.lookup([8] * 8) == {"w": 8} and idx.lookup([9] * 8) == {"w": 8}, 10)
        assert all(idx.lookup([i] * 8) == {} for i in range(5))
        assert s.counts["restarts"] >= 1
        pub2.publish(fe.encode_batch("vllm", [fe.cleared("vllm")]))
        assert wait(lambda: idx.lookup([8] * 8) == {})
    finally:
        s.stop()
        s.join(2)


async def _kv_events_harness(h, stream_env, fmt):
    """Give each of h's plain workers a live KV event stream of format `fmt`; their publishers."""
    pubs = [stream_env() for _ in h.plain]
    for w, (pub, ep) in zip(h.plain, pubs):
        rw = h.router.pool.workers[w.url]
        h.router.pool.remove(w.url)
        rw.kv_events, rw.kv_replay = ep
        h.router.add_worker(rw)
    return [pub for pub, _ in pubs]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_kv_events_policy_routes_to_the_worker_holding_the_prefix(stream_env, engine):
    """Text prompts: the router gets their token ids from a worker's POST /tokenize (both engines
    serve it; --tokenize auto is the default)."""
    async def main():
        async with Harness(engine=engine, plain=2, policy="kv_events") as h:
            pubs = await _kv_events_harness(h, stream_env, engine)
            text = "the quick brown fox jumps over the lazy dog" * 2
            toks = [ord(c) for c in text]  # the fake worker's /tokenize
            policy = h.router.policies["plain"]
            for _ in range(250):  # again until seen: a subscription still joining misses what is sent
                publish(pubs[1], engine, toks[: len(toks) // BS * BS])
                await asyncio.sleep(0.02)
                if policy.index.lookup(toks):
                    break
            for _ in range(4):
                status, _, _ = await h.post("/v1/completions", {"model": "fake-model", "prompt": text, "max_tokens": 2})
                assert status == 200
            assert len(h.plain[1].requests) == 4 and not h.plain[0].requests
            status, stats = await h.get("/admin/policies")
            assert stats["plain"]["policy"] == "kv_events" and stats["plain"]["index"]["stored"] > 0
    run(main())


def test_workers_without_tokenize_are_asked_once_then_text_prompts_use_the_prefix_match(stream_env, caplog):
    async def main():
        async with Harness(plain=2, policy="kv_events", worker_opts={"serves_tokenize": False}) as h:
            await _kv_events_harness(h, stream_env, "vllm")
            with Decisions() as seen:
                for i in range(3):
                    status, _, _ = await h.post("/v1/completions", {"model": "fake-model", "prompt": "hello world",
                                                                    "max_tokens": 2}, headers={"X-Request-Id": f"r{i}"})
                    assert status == 200
            assert len(seen) == 3 and all(r.startswith("degraded (no token ids)") for _, r in seen.values()), seen
            assert not h.router.orchestrator._ask_tokens
    with caplog.at_level("WARNING", logger="pdsdk.router.orchestrator"):
        run(main())
    assert len([r for r in caplog.records if "has no POST /tokenize" in r.getMessage()]) == 1


def run(coro):
    return asyncio.run(coro)
