"""The kv_events policy fed by real vLLM engines: their ZMQ KV event streams fill the router's
exact index, a prompt goes to the engine that holds its blocks (as many tokens as that engine
cached, to the block), and an engine's prefix cache reset (AllBlocksCleared) empties its part of
the index."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid

import aiohttp
import pytest
from engine.servers import VllmServer, start_all
from pdsdk.launch.plan import KV_EVENTS_CONFIG
from pdsdk.ports import free_port
from pdsdk.router.config import RouterConfig
from pdsdk.router.server import start
from pdsdk.testing.router_harness import Decisions

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]
BS = 32  # the engines' block size (VllmServer's default)
PROMPTS = {"p": "Prefill and decode run on different workers. " * 25,
           "q": "The quick brown fox jumps over the lazy dog. " * 25,
           "r": "Paris is the capital of France and " * 25}


def publishing(name: str, model: str, tmp_path, cores: str) -> tuple[VllmServer, str, str]:
    """A plain vLLM publishing its KV events (and serving /reset_prefix_cache, a dev endpoint)."""
    pub, replay = free_port(), free_port()
    cfg = {**KV_EVENTS_CONFIG["vllm"], "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
    server = VllmServer(name, model, tmp_path, cores=cores, env={"VLLM_SERVER_DEV_MODE": "1"},
                        extra_args=("--kv-events-config", json.dumps(cfg)))
    return server, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"


def url(server: VllmServer) -> str:
    return f"http://127.0.0.1:{server.port}"


def token_count(server: VllmServer, prompt: str) -> int:
    req = urllib.request.Request(url(server) + "/tokenize", data=json.dumps({"model": "tiny", "prompt": prompt}).encode(),
                                 headers={"Content-Type": "application/json"})
    return len(json.loads(urllib.request.urlopen(req, timeout=30).read())["tokens"])


def test_kv_events_route_to_the_engine_holding_the_prefix(model, tmp_path):
    a, a_pub, a_replay = publishing("a", model, tmp_path, "0")
    b, b_pub, b_replay = publishing("b", model, tmp_path, "1")
    try:
        start_all(a, b)
        with Decisions() as decisions:
            asyncio.run(_scenario(a, b, {url(a): a_pub, url(b): b_pub}, {url(a): a_replay, url(b): b_replay},
                                  decisions))
    finally:
        a.stop()
        b.stop()


async def _scenario(a: VllmServer, b: VllmServer, events: dict, replay: dict, decisions: dict) -> None:
    cfg = RouterConfig(port=0, engine="vllm", workers=[url(a), url(b)], policy="kv_events", kv_events=events,
                       kv_replay=replay, health_interval_s=0.5)
    router, runner, port = await start(cfg)
    policy = router.policies["plain"]
    lengths = {name: token_count(a, p) for name, p in PROMPTS.items()}
    assert all(n >= 4 * BS and n % BS for n in lengths.values()), lengths  # several blocks and a partial one
    held = {name: n // BS * BS for name, n in lengths.items()}  # engines cache full blocks only

    def blocks(worker: str) -> int:
        return sum(n for src, n in policy.stats()["blocks"].items() if src.startswith(worker + "@"))

    async def until(check, what: str) -> None:
        deadline = time.monotonic() + 30
        while not check():
            assert time.monotonic() < deadline, f"{what}: {policy.stats()}"
            await asyncio.sleep(0.1)

    async with aiohttp.ClientSession() as http:

        async def ask(name: str) -> tuple[str, str]:
            rid = uuid.uuid4().hex
            body = {"model": "tiny", "prompt": PROMPTS[name], "max_tokens": 4, "temperature": 0}
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                                 headers={"X-Request-Id": rid}) as r:
                assert r.status == 200, await r.text()
                await r.read()
            return decisions[rid]

        try:
            streams = lambda: policy.stats()["streams"].values()
            await until(lambda: len(streams()) == 2 and all(s["state"] == "exact" for s in streams()),
                        "both event streams caught up")
            w, reason = await ask("r")  # nothing cached anywhere yet
            assert reason.startswith("kv-miss"), reason
            # p and q straight to one engine each: the router learns of them only from the events
            for server, name in ((a, "p"), (b, "q")):  # off the loop: the router keeps serving meanwhile
                await asyncio.to_thread(server.complete, {"model": "tiny", "prompt": PROMPTS[name], "max_tokens": 4,
                                                          "temperature": 0})
            await until(lambda: blocks(url(a)) >= held["p"] // BS and blocks(url(b)) >= held["q"] // BS,
                        "p's and q's blocks indexed")
            # each goes where its blocks are, matched to the block: the router's keys of the prompt
            # equal its keys of the engine's own BlockStored token ids
            for name, where in (("p", url(a)), ("q", url(b)), ("p", url(a))):
                w, reason = await ask(name)
                assert w == where and reason.startswith(f"kv-hit {held[name]}/{lengths[name]} "), (name, w, reason)
            counts = policy.stats()["index"]
            assert counts["stored"] > 0 and counts["orphans"] == 0 and counts["ignored"] == 0, counts
            # b drops its prefix cache: AllBlocksCleared empties b's part of the index, a's stays
            reset = urllib.request.Request(url(b) + "/reset_prefix_cache", method="POST")
            answer = await asyncio.to_thread(lambda: urllib.request.urlopen(reset, timeout=30).read())
            assert json.loads(answer)["success"] is True
            # an idle engine publishes nothing: its events go out with its next step
            await asyncio.to_thread(b.complete, {"model": "tiny", "prompt": "Hi", "max_tokens": 1, "temperature": 0})
            await until(lambda: blocks(url(b)) == 0, "b's blocks cleared")
            assert policy.stats()["index"]["cleared"] >= 1
            w, reason = await ask("q")
            assert reason.startswith("kv-miss"), (w, reason)
            w, reason = await ask("p")
            assert w == url(a) and reason.startswith(f"kv-hit {held['p']}/"), (w, reason)
        finally:
            await runner.cleanup()
