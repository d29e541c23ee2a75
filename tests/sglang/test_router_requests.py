"""What the router sends to SGLang's HTTP server, parsed by SGLang's own request models (in-process,
no servers): the PD bodies with their bootstrap fields, and POST /tokenize for kv_events routing."""

from __future__ import annotations

import pytest

from pdsdk.router.orchestrator import tokenize_request
from pdsdk.router.pd_bodies import new_room, sglang_pd_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
COMPLETION = {"model": "m", "prompt": "Once upon a time", "max_tokens": 4}


@pytest.fixture(scope="module")
def protocol():
    from sglang.srt.entrypoints.openai import protocol

    return protocol


@pytest.mark.parametrize("host", ["10.0.0.7", "fd00::7"])
def test_pd_bodies_keep_their_bootstrap_fields(protocol, host):
    room = new_room()
    chat = protocol.ChatCompletionRequest.model_validate(sglang_pd_body(CHAT, host, 8998, room, 1, {}))
    assert (chat.bootstrap_host, chat.bootstrap_port, chat.bootstrap_room) == \
        (host if ":" not in host else f"[{host}]", 8998, room)
    batch = dict(COMPLETION, prompt=["a", "b", "c"])
    done = protocol.CompletionRequest.model_validate(sglang_pd_body(batch, host, None, room, 3, {"priority": 1}))
    assert done.bootstrap_room == [room, room + 1, room + 2] and done.bootstrap_port == [None] * 3


@pytest.mark.parametrize("body", [CHAT, COMPLETION], ids=["chat", "completion"])
def test_tokenize_requests_parse_and_answers_carry_tokens(protocol, body):
    ask = tokenize_request(body, body.get("prompt"))
    req = protocol.TokenizeRequest.model_validate(ask)
    assert (req.messages is not None) == ("messages" in body) and (req.prompt is not None) == ("prompt" in body)
    assert "tokens" in protocol.TokenizeResponse.model_fields  # where the router reads the ids
