"""PD orchestration against fake workers that check vLLM's and SGLang's request semantics."""

from __future__ import annotations

import asyncio

from pdsdk.router import pd_bodies as pd
from pdsdk.testing.router_harness import Harness

BODY = {"model": "fake-model", "prompt": "hello world", "max_tokens": 3}


def run(coro):
    return asyncio.run(coro)


def test_vllm_prefill_and_decode_bodies_follow_nixl_protocol():
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 2,
            "max_completion_tokens": 9, "pdsdk": {"session": "s"}}
    p = pd.vllm_prefill_body(body, {"session": "s"})
    assert p["kv_transfer_params"] == {**pd.PREFILL_PARAMS, "pdsdk_hints": {"session": "s"}}
    assert p["stream"] is False and p["max_tokens"] == 1 and p["max_completion_tokens"] == 1
    assert not {"stream_options", "min_tokens", "pdsdk"} & set(p)
    returned = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e",
                "remote_request_id": "r", "remote_host": "h", "remote_port": 1, "tp_size": 1}
    d = pd.vllm_decode_body(body, returned, {})
    assert d["kv_transfer_params"] == returned  # verbatim
    assert d["stream"] is True and d["stream_options"] == {"include_usage": True} and d["max_tokens"] == 3
    assert "pdsdk" not in d


def test_sglang_bodies_and_rooms():
    b = pd.sglang_pd_body(BODY, "::1", 8998, 5, 1, {})
    assert (b["bootstrap_host"], b["bootstrap_port"], b["bootstrap_room"]) == ("[::1]", 8998, 5)
    b = pd.sglang_pd_body({**BODY, "prompt": ["a", "b"]}, "10.0.0.1", None, 7, 2, {"priority": 1})
    assert b["bootstrap_room"] == [7, 8] and b["bootstrap_host"] == ["10.0.0.1"] * 2
    assert b["bootstrap_port"] == [None, None] and b["pdsdk"] == {"priority": 1}
    rooms = {pd.new_room() for _ in range(100)}
    assert len(rooms) == 100 and all(0 <= r < 2**63 for r in rooms)
    assert any(r >= 2**62 for r in rooms)  # uses the full 63 bits


def test_new_request_ids_are_unique_here_and_in_a_forked_child():
    import os
    import re

    from pdsdk.router.http.client_request import new_request_id

    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(re.fullmatch("[0-9a-f]{32}", i) for i in ids)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child forked from a router process (as multiprocessing may) starts its own series
        os.write(w, new_request_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(r, 64).decode()
    os.close(r)
    os.close(w)
    assert child not in ids and child[:16] != next(iter(ids))[:16]


def test_vllm_pd_end_to_end_same_request_id():
    async def main():
        async with Harness("vllm", prefill=1, decode=1) as h:
            status, out, headers = await h.post("/v1/completions", BODY)
            assert status == 200, out
            assert out["choices"][0]["text"] == "tok0 tok1 tok2"
            (preq,), (dreq,) = h.prefill[0].requests, h.decode[0].requests
            assert preq["body"]["kv_transfer_params"]["do_remote_decode"] is True
            params = dreq["body"]["kv_transfer_params"]
            assert params["remote_engine_id"] == h.prefill[0].engine_id
            assert preq["headers"]["x-request-id"] == dreq["headers"]["x-request-id"]
            assert headers["x-request-id"]
    run(main())


def test_sglang_pd_sends_same_body_to_both_with_bootstrap_fields():
    async def main():
        async with Harness("sglang", prefill=1, decode=1) as h:
            h.router.pool.workers[h.prefill[0].url].bootstrap_port = 8998
            status, out, _ = await h.post("/v1/completions", {**BODY, "stream": True})
            assert status == 200 and "tok2" in out
            (preq,), (dreq,) = h.prefill[0].requests, h.decode[0].requests
            assert preq["body"] == dreq["body"]
            assert preq["body"]["bootstrap_host"] == "127.0.0.1"
            assert preq["body"]["bootstrap_port"] == 8998
            assert 0 <= preq["body"]["bootstrap_room"] < 2**63
            status, out, _ = await h.post("/v1/completions", BODY)
            assert status == 200 and h.prefill[0].requests[1]["body"]["bootstrap_room"] != \
                preq["body"]["bootstrap_room"]
    run(main())


def test_plain_mode_round_robin_and_hints_reach_workers():
    async def main():
        async with Harness("vllm", plain=2, policy="round_robin") as h:
            for _ in range(4):
                status, _, _ = await h.post("/v1/completions", {**BODY, "nvext": {"agent_hints": {"priority": 3}}},
                                            headers={"X-Pdsdk-Session": "abc"})
                assert status == 200
            assert [len(w.requests) for w in h.plain] == [2, 2]
            sent = h.plain[0].requests[0]["body"]
            assert sent["kv_transfer_params"] == {"pdsdk_hints": {"priority": 3, "session": "abc"}}
    run(main())


def test_sglang_plain_mode_keeps_hints_in_pdsdk_field():
    async def main():
        async with Harness("sglang", plain=1) as h:
            await h.post("/v1/completions", {**BODY, "pdsdk": {"pin": True, "ttl_s": 60}})
            assert h.plain[0].requests[0]["body"]["pdsdk"] == {"pin": True, "ttl_s": 60.0}
            assert "bootstrap_room" not in h.plain[0].requests[0]["body"]
    run(main())


def test_conditional_disaggregation_short_prompt_goes_to_decode_alone():
    async def main():
        async with Harness("vllm", prefill=1, decode=1, disagg_threshold=100) as h:
            status, _, _ = await h.post("/v1/completions", {**BODY, "prompt": list(range(20))})
            assert status == 200
            assert not h.prefill[0].requests and "kv_transfer_params" not in h.decode[0].requests[0]["body"]
            status, _, _ = await h.post("/v1/completions", {**BODY, "prompt": list(range(500))})
            assert status == 200 and len(h.prefill[0].requests) == 1
    run(main())


def test_conditional_disaggregation_counts_cached_prefix():
    async def main():
        async with Harness("vllm", prefill=1, decode=1, disagg_threshold=100, policy="prefix") as h:
            long = {**BODY, "prompt": list(range(400))}
            await h.post("/v1/completions", long)
            assert len(h.prefill[0].requests) == 1
            # same prompt plus a short tail: decode holds the prefix, 50 new tokens < 100
            await h.post("/v1/completions", {**BODY, "prompt": list(range(400)) + [7] * 50})
            assert len(h.prefill[0].requests) == 1 and len(h.decode[0].requests) == 2
    run(main())


def test_prefill_without_kv_transfer_params_still_serves_and_counts():
    async def main():
        async with Harness("vllm", prefill=1, decode=1) as h:
            h.prefill[0].engine = "none"  # behaves like vLLM without a KV connector: no params back
            status, out, _ = await h.post("/v1/completions", BODY)
            assert status == 200
            assert "kv_transfer_params" not in h.decode[0].requests[0]["body"]
            _, metrics = await h.get("/metrics")
            assert "pdsdk_router_pd_missing_kv_transfer_params_total" in metrics
    run(main())
