"""The `prefix` policy's tree holds at most its byte cap over all workers, whatever clients send."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tracemalloc

import aiohttp
import pytest

from pdsdk.ports import free_port
from pdsdk.router.policies.base import RouteRequest
from pdsdk.router.policies.prefix import Prefix
from pdsdk.router.policies.prefix_tree import PrefixTree
from pdsdk.router.workers import Worker


def unique_prompt(i: int, size: int = 30_000) -> str:
    return f"{i:08d} " + os.urandom(size // 2).hex()[: size - 9]


def test_tree_memory_stays_under_its_byte_cap_and_still_routes():
    workers = [Worker(f"http://10.0.0.{i}:8000") for i in range(3)]
    cap = 2 << 20
    p = Prefix(max_bytes=cap)
    prompts = [unique_prompt(i) for i in range(300)]  # 300 x 469 chunks: 7x what the cap holds
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i, text in enumerate(prompts):
            p.choose(workers, RouteRequest(f"r{i}", text=text))
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(p.tree) <= cap // PrefixTree.ENTRY_BYTES
    assert held < cap * 1.25, held  # the estimate per chunk holds, with the dict's own slack
    assert sum(p.stats()["tree_chunks"].values()) >= len(p.tree)
    # the newest prompts are still known; a repeat goes back to where it went
    first = p.choose(workers, RouteRequest("again", text=prompts[-1]))
    assert first.reason.startswith("prefix-hit")
    for w in workers:
        p.remove_worker(w)
    assert len(p.tree) == 0 and p.tree.sizes() == {}


def test_tree_shares_chunks_between_workers_and_frees_bits():
    t = PrefixTree(max_chunks=100)
    keys = list(range(10))
    t.insert("a", keys)
    t.insert("b", keys[:5])
    assert t.match(keys) == {"a": 10, "b": 5} and len(t) == 10
    assert t.match(keys, among={"b"}) == {"b": 5}
    t.remove_worker("a")
    assert t.match(keys) == {"b": 5} and len(t) == 5 and t.size("a") == 0
    t.insert("c", keys)  # takes a's freed bit
    assert t.match(keys) == {"b": 5, "c": 10} and t.sizes() == {"b": 5, "c": 10}


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_router_memory_with_2800_unique_30kb_prompts():
    """The reproduction: 2,800 unique 30 KB prompts took a `prefix` router from 59 to 481 MiB."""
    wport, rport = free_port(), free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "pdsdk.testing.fake_worker", "--port", str(wport),
                               "--chunks", "1"], cwd="/"),
             subprocess.Popen([sys.executable, "-m", "pdsdk", "router", "--port", str(rport), "--policy", "prefix",
                               "--worker", f"http://127.0.0.1:{wport}"], cwd="/")]

    async def main() -> tuple[float, float]:
        url = f"http://127.0.0.1:{rport}"
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                try:
                    async with s.get(url + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
            before = _rss_mib(procs[1].pid)
            sem = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with sem, s.post(url + "/v1/completions", json={"model": "fake-model", "max_tokens": 1,
                                                                       "prompt": unique_prompt(i)}) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
            await asyncio.gather(*(one(i) for i in range(2800)))
            return before, _rss_mib(procs[1].pid)

    try:
        before, after = asyncio.run(main())
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    print(f"router RSS {before:.0f} -> {after:.0f} MiB")
    assert after - before < 100, (before, after)  # the tree's 64 MiB cap, and the traffic's own buffers
