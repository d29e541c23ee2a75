"""Fuzz: request bodies against a real router and its fake workers on loopback, in plain and PD
modes. Whatever the body, the answer is not a 5xx, nothing is logged with a traceback, and no
worker's breaker moves."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rawhttp import LiveRouter, exchange, request

pytestmark = pytest.mark.slow  # the fuzz tier: `make test`, about 15-30 s for the router's part
FUZZ = settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))

# text with everything JSON can carry: controls, lone surrogates (as \u escapes), astral characters
text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | text
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(text, inner, max_size=4), max_leaves=12)
hint_values = st.dictionaries(st.sampled_from(["priority", "ttl_s", "pin", "session", "keep", "bogus"]),
                              json_values, max_size=4)
part = st.fixed_dictionaries({}, optional={"type": st.sampled_from(["text", "image_url"]) | json_values,
                                           "text": text | json_values})
content = text | st.lists(part | json_values, max_size=3) | json_values
message = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system"]) | json_values,
                                              "content": content})
common = {"model": st.just("fake-model") | json_values, "stream": st.booleans() | json_values,
          "max_tokens": st.integers(-3, 5) | json_values, "pdsdk": hint_values | json_values,
          "nvext": st.fixed_dictionaries({"agent_hints": hint_values | json_values}) | json_values,
          "kv_transfer_params": json_values, "extra": json_values}
completions = st.fixed_dictionaries({}, optional={
    "prompt": text | st.lists(st.integers(-2**70, 2**70), max_size=20) | st.lists(text, max_size=3) | json_values,
    **common})
chat = st.fixed_dictionaries({}, optional={"messages": st.lists(message | json_values, max_size=4) | json_values,
                                           **common})


def encode(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # ensure_ascii: a lone surrogate goes as its \u escape


@pytest.fixture(scope="module", ids=["plain", "vllm-pd", "sglang-pd"],
                params=[("vllm", {"plain": 1, "policy": "prefix"}),
                        ("vllm", {"prefill": 1, "decode": 1, "policy": "session"}),
                        ("sglang", {"prefill": 1, "decode": 1})])
def router(request):
    engine, kw = request.param
    with LiveRouter(engine=engine, read_timeout_s=1.0, **kw) as r:
        yield r
        assert not r.log.tracebacks(), r.log.tracebacks()[:5]
        assert set(r.breakers().values()) == {("closed", 0)}  # nothing a client sent counted against a worker


def check(r: LiveRouter, path: str, raw_body: bytes) -> None:
    status, body = exchange(r.port, request(path, raw_body))
    assert 200 <= status < 500, (status, raw_body[:200], body[:300])


@FUZZ
@given(body=completions)
def test_router_completions_bodies(router, body):
    check(router, "/v1/completions", encode(body))


@FUZZ
@given(body=chat)
def test_router_chat_bodies(router, body):
    check(router, "/v1/chat/completions", encode(body))


@FUZZ
@given(raw=st.binary(max_size=200) | st.builds(lambda b, cut: encode(b)[:cut], completions, st.integers(0, 300)))
def test_router_raw_bodies(router, raw):
    check(router, "/v1/completions", raw)
