"""vLLM PD through PdsdkConnector on CPU, checked the hard way: greedy outputs through prefill +
decode equal, token for token, those of one non-disaggregated vLLM on the same prompts."""

from __future__ import annotations

import urllib.request

import pytest
from engine.conftest import MAX_TOKENS, PROMPTS
from engine.servers import VllmServer, pd_complete, start_all
from helpers import eventually

from pdsdk.testing.plugins import plugin_env

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]


def pd_pair(model, tmp_path, transport: str, decode_env: dict | None = None, decode_block_size: int = 32,
            decode_transport: dict | None = None):
    prefill = VllmServer("prefill", model, tmp_path, cores="0", role="prefill", pdsdk_config={"transport": transport})
    decode = VllmServer("decode", model, tmp_path, cores="1", role="decode",
                        pdsdk_config={"transport": decode_transport or transport}, env=decode_env,
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
    prefill, decode = pd_pair(model, tmp_path, "nixl", decode_env=plugin_env(tmp_path / "site", "pdsdk.testing.faults"),
                              decode_transport={"name": "corrupt_reads", "options": {"inner": "nixl"}})
    try:
        outputs = [pd_complete(prefill, decode, p, MAX_TOKENS)[0] for p in PROMPTS]
        assert sum(a != b for a, b in zip(outputs, baseline)) >= len(PROMPTS) - 1
        assert "corrupt_reads: scribbled over" in decode.log_text()
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



def kv_usage(server: VllmServer) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:kv_cache_usage_perc"))


def test_a_prefill_whose_decode_never_reads_frees_its_pages_at_the_lease(model, tmp_path):
    """The decode worker died (or the router gave up on it) after the prefill answered: nobody reads
    the pages the prefill holds for it. They are freed when the lease runs out, not kept for good."""
    prefill = VllmServer("prefill", model, tmp_path, cores="0-1", role="prefill",
                         pdsdk_config={"transport": "nixl", "timeouts": {"lease_s": 6}})
    start_all(prefill)
    try:
        for prompt in PROMPTS[1:4]:
            prefill.complete({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                              "kv_transfer_params": {"do_remote_decode": True}})
        held = kv_usage(prefill)
        assert held > 0, "the prefill holds no pages for its decode"
        assert eventually(lambda: kv_usage(prefill) == 0, timeout=60, interval=1), kv_usage(prefill)
        assert prefill.log_text().count("expired before every decode reader read it") == 3, prefill.tail()
    finally:
        prefill.stop()
