"""Prefix reuse through pdsdk stores in one vLLM engine: with vLLM's own prefix cache off, a repeated
or extended prompt loads its prefix pages from the store, and the answer does not change."""

from __future__ import annotations

import json
import time

import pytest
from engine.conftest import MAX_TOKENS, PROMPTS
from engine.servers import VllmServer, start_all

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_store_hits_give_the_same_answers(store, model, baseline, tmp_path):
    spec = {"name": "disk", "options": {"path": str(tmp_path / "pages")}} if store == "disk" else "memory"
    server = VllmServer("engine", model, tmp_path, cores="0-1", role="both",
                        pdsdk_config={"transport": None, "store": spec},
                        env={"PDSDK_STATS_DIR": str(tmp_path / "stats")},
                        extra_args=("--no-enable-prefix-caching",))
    start_all(server)
    try:
        long_prompts = [p for p in PROMPTS if len(p) > 100]
        body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0}
        for round_ in range(2):  # the first round saves pages, the second loads them
            for prompt in long_prompts:
                out = server.complete({**body, "prompt": prompt})["choices"][0]["text"]
                assert out == baseline[PROMPTS.index(prompt)], f"round {round_}"
        time.sleep(2.5)
        stats = [json.loads(p.read_text()) for p in (tmp_path / "stats").glob("*.json")]
        assert stats and stats[0]["store"]["hits"] > 0 and stats[0]["store"]["puts"] > 0, stats
        assert "store had" not in server.log_text(), server.tail()
    finally:
        server.stop()
