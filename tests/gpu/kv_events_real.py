"""GPU machine: the kv_events policy over a real engine (vLLM 0.26 or SGLang 0.5.15.post1 there).

Two plain workers on GPUs 0 and 1, started from `pdsdk launch --policy kv_events`'s own plan (each
publishes its KV events on local sockets). Each gets one long prompt straight from this script; the
router (in process, its decisions recorded through the pdsdk_route_decision hook) must then send
each prompt to the worker holding it, with the hit as long as that worker's cached blocks. Twice:
prompts of token ids, then chat messages of text, which the router tokenizes through a worker's
POST /tokenize (the engine's own tokenizer and chat template).
Usage: python3 tests/gpu/kv_events_real.py ENGINE MODEL_DIR   (JSON and logs under $OUT)
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import aiohttp
from pdsdk.router.config import RouterConfig
from pdsdk.router.server import start
from pdsdk.testing.router_harness import Decisions

from pdsdk.launch.plan import LaunchOptions, build_plan
from pdsdk.launch.supervisor import Supervisor
from pdsdk.ports import free_port

OUT = Path(os.environ.get("OUT", "/tmp/out"))
ARGS = {"vllm": ["--gpu-memory-utilization", "0.85", "--max-model-len", "4096"],
        "sglang": ["--mem-fraction-static", "0.8", "--context-length", "4096"]}
CPU = os.environ.get("PDSDK_KV_EVENTS_CPU") == "1"  # a dry run of this script with vLLM on CPU (tiny model)
PROMPT_TOKENS = 1500
# chat text of PROMPT_TOKENS // 4 words: about 1600 tokens with the tiny models' 512-entry vocabulary
WORDS = "river stone cloud lamp garden paper orange window silver music forest candle bridge winter".split()


async def scenario(plan, decisions: dict) -> dict:
    urls = [w.url for w in plan.workers]
    cfg = RouterConfig(port=0, engine=plan.engine, workers=urls, policy="kv_events",
                       kv_events={w.url: w.kv_events[0] for w in plan.workers},
                       kv_replay={w.url: w.kv_events[1] for w in plan.workers})
    router, runner, port = await start(cfg)
    policy = router.policies["plain"]
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 500) for _ in range(PROMPT_TOKENS)] for _ in urls]
    out: dict = {"engine": plan.engine, "prompt_tokens": PROMPT_TOKENS, "checks": []}

    def blocks(url: str) -> int:
        return sum(n for src, n in policy.stats()["blocks"].items() if src.startswith(url + "@"))

    async def until(check, what: str, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while not check():
            if time.monotonic() > end:
                raise TimeoutError(f"{what}: {json.dumps(policy.stats(), default=str)[:2000]}")
            await asyncio.sleep(0.1)

    try:
        async with aiohttp.ClientSession() as http:
            async def complete(base: str, prompt: list[int] | str, rid: str) -> None:
                body = {"model": plan.served_name, "max_tokens": 4, "temperature": 0}
                if isinstance(prompt, str):
                    path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
                else:
                    path, body["prompt"] = "/v1/completions", prompt
                async with http.post(base + path, json=body, headers={"X-Request-Id": rid}) as r:
                    if r.status != 200:
                        raise RuntimeError(f"{base}: HTTP {r.status}: {(await r.text())[:300]}")
                    await r.read()

            async def routed_to_holders(kind: str, prompts: list) -> None:
                before = {u: blocks(u) for u in urls}
                for url, prompt in zip(urls, prompts):
                    await complete(url, prompt, f"direct-{kind}-{url}")
                await until(lambda: all(blocks(u) > before[u] for u in urls), f"{kind} blocks indexed")
                await asyncio.sleep(1)  # the rest of the events of those two requests
                for i in range(4):
                    want, prompt, rid = urls[i % 2], prompts[i % 2], f"routed-{kind}-{i}"
                    await complete(f"http://127.0.0.1:{port}", prompt, rid)
                    worker, reason = decisions[rid]
                    out["checks"].append({"prompt": kind, "want": want, "got": worker, "reason": reason,
                                          "ok": worker == want and reason.startswith("kv-hit")})

            streams = lambda: policy.stats()["streams"].values()
            await until(lambda: len(streams()) == 2 and all(s["state"] == "exact" for s in streams()), "streams")
            await routed_to_holders("token-ids", prompts)
            await routed_to_holders("chat-text", [" ".join(rng.choice(WORDS) for _ in range(PROMPT_TOKENS // 4))
                                                  for _ in urls])
            out["block_size"] = dict(policy.index.block_size)
            out["stats"] = policy.stats()
    finally:
        await runner.cleanup()
    return out


def main(engine: str, model: str) -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    plan = build_plan(LaunchOptions(engine=engine, model=model, served_name="m", port=free_port(), prefill=0,
                                    decode=2, gpus=None if CPU else [0, 1], policy="kv_events",
                                    engine_args=["--max-model-len", "2048"] if CPU else ARGS[engine]))
    sup = Supervisor(plan, OUT / f"logs-kv-events-{engine}", echo=False)
    try:
        sup.start(plan.workers)
        sup.wait_healthy(plan.workers, 420)
        with Decisions() as decisions:
            result = asyncio.run(scenario(plan, decisions))
    except Exception as e:  # noqa: BLE001 - the record says what failed
        result = {"engine": engine, "error": f"{type(e).__name__}: {e}"}
    finally:
        sup.stop()
    (OUT / f"kv-events-{engine}.json").write_text(json.dumps(result, indent=1, default=str))
    for c in result.get("checks", []):
        print(f"kv-events {engine}: {'OK ' if c['ok'] else 'BAD'} {c['prompt']}: want {c['want']} got {c['got']}: "
              f"{c['reason']}")
    print(f"kv-events {engine}: block_size {result.get('block_size')} index {result.get('stats', {}).get('index')} "
          f"{result.get('error', '')}")
    return 0 if result.get("checks") and all(c["ok"] for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
