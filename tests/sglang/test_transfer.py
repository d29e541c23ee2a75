"""The pdsdk transfer backend between real processes, driven through SGLang's classes the way its
scheduler drives them: a prefill process (bootstrap server, manager, sender) and a decode process
(manager, receiver), SGLang's own KV pool and metadata buffers on CPU, for every pdsdk transport."""

from __future__ import annotations

import time

import pytest
from helpers import need_plugin

from pdsdk.plugins import registry
from pdsdk.ports import free_port

SUCCESS, FAILED = 4, 0  # KVPoll values


@pytest.mark.slow
@pytest.mark.parametrize("transport", registry().names("transport"))
def test_pages_arrive_intact(pd, transport):
    need_plugin(registry().get("transport", transport))
    if registry().load("transport", transport).IN_PROCESS:
        pytest.skip(f"{transport}'s peers live in one process; prefill and decode run apart here")
    port, room = free_port(), 2**62 + 12345  # rooms are random u63 from the router
    prefill = pd("prefill", port, room, transport)
    decode = pd("decode", port, room, transport)
    got = decode.until("done")
    sent = prefill.until("done")
    assert sent["state"] == SUCCESS, sent
    assert got["state"] == SUCCESS, got
    assert got["digest"] == sent["digest"], "decode's pages differ from what prefill sent"
    assert got["room_landed"] == room  # SGLang's "metadata landed" gate passes
    assert sent["bytes"] == 12 * 6 * 2048  # 12 pages x (3 layers x K,V) x 2 KiB
    print(f"{transport}: 12 pages in 3 chunks, prefill {sent['seconds'] * 1e3:.1f} ms via {sent['path']}")


@pytest.mark.slow
def test_junk_on_the_control_socket_is_refused_and_the_transfer_still_works(pd):
    port, room = free_port(), 777
    prefill = pd("prefill", port, room, "local", "--hostile")
    assert prefill.until("refused")["count"] == 3  # a bad abort room, undecodable msgpack, an unknown tag
    decode = pd("decode", port, room, "local")
    got, sent = decode.until("done"), prefill.until("done")
    assert got["state"] == sent["state"] == SUCCESS, (got, sent)
    assert got["digest"] == sent["digest"]


@pytest.mark.slow
def test_killed_prefill_fails_the_request_with_a_reason(pd):
    port, room = free_port(), 987654321
    env = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1"}
    prefill = pd("prefill", port, room, "local", "--hang", env=env)
    decode = pd("decode", port, room, "local", "--timeout", "60", env=env)
    assert prefill.until("hanging")["event"] == "hanging"
    assert decode.until("metadata_sent")["event"] == "metadata_sent"
    killed = time.monotonic()
    prefill.proc.kill()
    got = decode.until("done", timeout=90)
    waited = time.monotonic() - killed
    assert got["state"] == FAILED, got
    assert "KVTransferError" in got["reason"] and "prefill" in got["reason"].lower(), got["reason"]
    assert waited < 30, f"the failure took {waited:.0f}s to surface"
    print(f"killed prefill -> KVPoll.Failed in {waited:.1f}s: {got['reason']}")


@pytest.mark.slow
def test_killed_decode_fails_the_prefill_side_with_a_reason(pd):
    port, room = free_port(), 31337  # decode dies after its request reached prefill, before the pages move
    prefill = pd("prefill", port, room, "local", "--delay-send", "3")
    decode = pd("decode", port, room, "local")
    assert prefill.until("delaying")["event"] == "delaying"  # decode's request arrived; prefill sends in 3 s
    decode.proc.kill()
    sent = prefill.until("done", timeout=90)
    assert sent["state"] == FAILED, sent
    assert "pdsdk local" in sent["reason"] and "decode" in sent["reason"], sent["reason"]
    print(f"killed decode -> prefill KVPoll.Failed: {sent['reason']}")


@pytest.mark.slow
def test_mismatched_kv_layout_fails_with_the_difference(pd):
    port, room = free_port(), 4242
    prefill = pd("prefill", port, room, "local")
    decode = pd("decode", port, room, "local", "--heads", "4")  # prefill has 2 KV heads per page
    got = decode.until("done")
    sent = prefill.until("done")
    assert got["state"] == sent["state"] == FAILED, (got, sent)
    assert "KV page bytes per buffer differ" in got["reason"], got["reason"]
    print(f"mismatched layout -> decode KVPoll.Failed: {got['reason']}")
