"""Heterogeneous TP on CPU through PdsdkConnector: prefill TP=2 -> decode TP=1 and prefill TP=1 ->
decode TP=2, pages sliced by KV head (the tiny model has 2 KV heads: one per rank at TP=2).

Greedy outputs through the pair equal those of one plain TP=1 engine; scribbling over the pages
after they land changes them; every prefill rank frees its pages on the decode ranks' read notes
(no lease ran out)."""

from __future__ import annotations

import pytest
from engine.conftest import MAX_TOKENS, PROMPTS
from engine.servers import VllmServer, pd_complete, start_all

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1500)]


def server(name, model, tmp_path, tp: int, role: str, transport: str, env: dict | None = None) -> VllmServer:
    # Two cores: prefill on core 0, decode on core 1, every rank of a TP=2 engine on its engine's core
    # ("0|0"). With "0|1" the TP=2 prefill's workers keep stepping on both cores while a send is pending,
    # and the decode on core 1 did not take the request before the prefill's lease ran out.
    core = "0" if role == "prefill" else "1"
    return VllmServer(name, model, tmp_path, cores="|".join([core] * tp),
                      role=role, pdsdk_config={"transport": transport}, env=env,
                      extra_args=("--tensor-parallel-size", "2") if tp == 2 else ())


def check_pair(prefill: VllmServer, decode: VllmServer, baseline: list[str], rounds: int = 2) -> None:
    for _ in range(rounds):  # the second round reuses the cached connections to every prefill rank
        outputs = [pd_complete(prefill, decode, p, MAX_TOKENS)[0] for p in PROMPTS]
        assert outputs == baseline, decode.tail()
    assert "KV load for request" not in decode.log_text(), decode.tail()
    assert "expired before" not in prefill.log_text(), prefill.tail()  # freed on reads, not on leases


@pytest.mark.parametrize("tp_p,tp_d,transport", [(2, 1, "local"), (1, 2, "nixl")])
def test_hetero_tp_outputs_equal_a_single_engine(tp_p, tp_d, transport, model, baseline, tmp_path):
    prefill = server("prefill", model, tmp_path, tp_p, "prefill", transport)
    decode = server("decode", model, tmp_path, tp_d, "decode", transport)
    try:
        start_all(prefill, decode)
        check_pair(prefill, decode, baseline)
    finally:
        prefill.stop()
        decode.stop()


def test_hetero_tp_decode_really_uses_the_sliced_pages(model, baseline, tmp_path):
    prefill = server("prefill", model, tmp_path, 2, "prefill", "local")
    decode = server("decode", model, tmp_path, 1, "decode", "local", env={"PDSDK_TEST_CORRUPT_KV": "1"})
    try:
        start_all(prefill, decode)
        outputs = [pd_complete(prefill, decode, p, MAX_TOKENS)[0] for p in PROMPTS]
        assert sum(a != b for a, b in zip(outputs, baseline)) >= len(PROMPTS) - 1
        assert "scribbled over" in decode.log_text()
    finally:
        prefill.stop()
        decode.stop()
