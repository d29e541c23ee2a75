"""Shared test helpers (importable as `helpers`: pyproject puts tests/ on sys.path).

Tests import pdsdk from the installed package, never from the tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# True in `make test`: a plugin that cannot load is a failure there, not a skip.
REQUIRE_ALL = os.environ.get("PDSDK_REQUIRE_ALL_PLUGINS") == "1"


def pdsdk_cli() -> str:
    """The installed console script beside the interpreter running the tests."""
    return shutil.which("pdsdk", path=str(Path(sys.executable).parent)) or "pdsdk"


def run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([pdsdk_cli(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


def need_plugin(spec) -> None:
    """Skip (or fail, under PDSDK_REQUIRE_ALL_PLUGINS=1) when a plugin cannot load here."""
    why = spec.why_not
    if why:
        (pytest.fail if REQUIRE_ALL else pytest.skip)(f"{spec.kind} {spec.name} cannot load here: {why}")


def eventually(check, timeout: float = 10.0, interval: float = 0.1) -> bool:
    """Poll `check` until it is true or `timeout` seconds pass; its last answer."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return bool(check())


def read_pages(store, keys, size: int) -> tuple[int, list[bytes]]:
    """(hit prefix length, the bytes of the hit pages) from a store's `get`."""
    out = [bytearray(size) for _ in keys]
    hits = store.get(keys, out)
    return hits, [bytes(o) for o in out[:hits]]


def span_digest(buf, spans) -> str:
    """sha256 of a host buffer's bytes at `spans` (rows of region, offset, length), in order: what a
    transport peer's `digest` call answers for its side."""
    import hashlib

    import numpy as np

    h = hashlib.sha256()
    for _, offset, length in np.asarray(spans).tolist():
        h.update(buf[offset:offset + length].tobytes())
    return h.hexdigest()


def vllm_scheduler(store) -> object:
    """PdsdkConnector's scheduler half with `store`, over the few vLLM config fields it reads."""
    from types import SimpleNamespace

    from pdsdk.adapters.vllm.scheduler import SchedulerSide
    from pdsdk.config import load_config

    kv = SimpleNamespace(kv_role="kv_both", get_from_extra_config=lambda key, default=None: default)
    vllm_config = SimpleNamespace(kv_transfer_config=kv, parallel_config=SimpleNamespace(tensor_parallel_size=1),
                                  cache_config=SimpleNamespace(block_size=16))
    config = load_config({"transport": None, "store": store})
    return SchedulerSide(vllm_config, config, "engine", config.fingerprint())


def vllm_request(rid: str, page_hashes: list[bytes], tokens: int) -> object:
    """The fields of a vLLM Request the scheduler half reads (a new prompt of `tokens` tokens)."""
    from types import SimpleNamespace

    return SimpleNamespace(request_id=rid, kv_transfer_params=None, num_prompt_tokens=tokens,
                           block_hashes=page_hashes, num_computed_tokens=0)
