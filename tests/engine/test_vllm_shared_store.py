"""Two vLLM engines share one pdsdk store: engine B reuses the pages engine A saved (its scheduler asks
the store, not only its own index), answers exactly like a plain engine, and reports the store hits
through vLLM's own connector stats: the "KV Transfer metrics" log line and `vllm:pdsdk_*` on /metrics.

- disk: B takes over A's directory (A stops, B starts): a disk store indexes its directory when it
  opens it, and one running engine owns a directory;
- redis: A and B run side by side from the start.
vLLM's own prefix cache is off, so every reused page must come from the store."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
from engine.conftest import MAX_TOKENS, PROMPTS
from engine.servers import VllmServer, start_all
from stores.servers import redis_server  # noqa: F401 - fixture

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1500)]
LONG = [p for p in PROMPTS if len(p) > 100]


def engine(name: str, model: str, tmp_path, cores: str, store: dict) -> VllmServer:
    return VllmServer(name, model, tmp_path, cores=cores, role="both",
                      pdsdk_config={"transport": None, "store": store},
                      env={"PDSDK_STATS_DIR": str(tmp_path / f"stats-{name}"), "VLLM_LOG_STATS_INTERVAL": "2"},
                      extra_args=("--no-enable-prefix-caching",))


def worker_stats(tmp_path, name: str) -> dict:
    files = list((tmp_path / f"stats-{name}").glob("*.json"))
    return json.loads(files[0].read_text())["store"] if files else {}


def wait_saved(tmp_path, name: str, timeout: float = 60) -> dict:
    """Until the engine's store saves (written on a thread, off the step) have settled."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        time.sleep(1.5)
        stats = worker_stats(tmp_path, name)
        if stats.get("puts") and stats == last:
            return stats
        last = stats
    raise TimeoutError(f"{name}: store saves did not settle: {last}")


def metrics(server: VllmServer) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^(vllm:pdsdk_\w+)(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.MULTILINE):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def serve(server: VllmServer, baseline: list[str]) -> None:
    for prompt in LONG:
        out = server.complete({"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert out["choices"][0]["text"] == baseline[PROMPTS.index(prompt)], (server.name, prompt[:40])


@pytest.mark.parametrize("store", ["disk", "redis"])
def test_second_engine_reuses_first_engines_pages(store, model, baseline, tmp_path, request):
    if store == "disk":
        spec = {"name": "disk", "options": {"path": str(tmp_path / "pages")}}
    else:
        server = request.getfixturevalue("redis_server")
        spec = {"name": "redis", "options": {"url": f"redis://127.0.0.1:{server.port}/0",
                                             "prefix": f"pdsdk-{tmp_path.name}:"}}
    a = engine("a", model, tmp_path, "0", spec)
    b = None
    try:
        if store == "redis":
            b = engine("b", model, tmp_path, "1", spec)
            start_all(a, b)
        else:
            start_all(a)
        serve(a, baseline)  # A computes every page and saves it
        saved = wait_saved(tmp_path, "a")
        assert saved["hits"] == 0, saved
        if b is None:  # disk: one running engine per directory (the disk store's rule); B takes over
            a.stop()
            b = engine("b", model, tmp_path, "1", spec)
            start_all(b)
        serve(b, baseline)  # B has never seen these prompts: its prefix pages come from A's saves
        time.sleep(5)  # the stats file (1 s) and vLLM's stats log interval (2 s here)
        hits = worker_stats(tmp_path, "b")
        assert hits.get("hits", 0) > 0, hits
        log = b.log_text()
        assert "store had" not in log, b.tail()  # every claimed page was there to load
        # vLLM's own connector stats: the log line and the Prometheus counters.
        lines = [line for line in log.splitlines() if "KV Transfer metrics" in line and "Store hit blocks" in line]
        assert lines, b.tail(60)
        m = metrics(b)
        assert m.get("vllm:pdsdk_store_hits_total", 0) == hits["hits"], m
        assert m.get("vllm:pdsdk_store_lookup_blocks_total", 0) >= hits["hits"], m  # found by asking the store
        assert m.get("vllm:pdsdk_store_lookups_total", 0) > 0, m
        assert m.get("vllm:pdsdk_store_load_seconds_count", 0) > 0, m
        if store == "redis":
            assert metrics(a).get("vllm:pdsdk_store_saves_total", 0) > 0, metrics(a)
    finally:
        for s in (a, b):
            if s is not None:
                s.stop()
