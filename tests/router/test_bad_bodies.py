"""Bodies and headers that made the router answer 500 with a traceback: each is now a 400 that
names the field, in plain and in PD mode, and nothing is logged with a traceback."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging

import pytest
from rawhttp import aexchange, request

from pdsdk.testing.router_harness import Harness

PROMPT = b'{"model": "fake-model", "max_tokens": 2, '
CASES = [  # (body, headers, what the error must name)
    (PROMPT + b'"prompt": "hi", "pdsdk": {"priority": 1e400}}', {}, "priority"),
    (PROMPT + b'"prompt": "hi", "pdsdk": {"priority": Infinity}}', {}, "priority"),
    (PROMPT + b'"prompt": "hi", "pdsdk": {"priority": NaN}}', {}, "priority"),
    (PROMPT + b'"prompt": "hi", "pdsdk": {"priority": 1.5}}', {}, "priority"),
    (PROMPT + b'"prompt": "hi", "pdsdk": {"priority": 99999999999999999999}}', {}, "priority"),
    (PROMPT + b'"prompt": "hi", "nvext": {"agent_hints": {"priority": 1e400}}}', {}, "priority"),
    (PROMPT + b'"prompt": "hi", "pdsdk": {"ttl_s": -1}}', {}, "ttl_s"),
    (PROMPT + b'"prompt": "hi", "pdsdk": {"ttl_s": Infinity}}', {}, "ttl_s"),
    (PROMPT + b'"prompt": "hi", "pdsdk": {"session": "' + b"s" * 300 + b'"}}', {}, "session"),
    (PROMPT + b'"prompt": "hi"}', {"X-Pdsdk-Priority": "1e400"}, "priority"),
    (PROMPT + b'"prompt": "hi"}', {"X-Pdsdk-Session": b"\xff\xfe"}, "session"),
    (PROMPT + b'"prompt": "hi"}', {"X-Pdsdk-Ttl": "nan"}, "ttl_s"),
    (PROMPT + b'"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}', {},
     "messages[0].content[0].text"),
    (PROMPT + b'"messages": [{"role": "user", "content": [7]}]}', {}, "messages[0].content[0]"),
    (PROMPT + b'"messages": [{"role": "user", "content": {"a": 1}}]}', {}, "messages[0].content"),
    (PROMPT + b'"messages": ["hi"]}', {}, "messages[0]"),
    (PROMPT + b'"messages": [{"role": 5, "content": "hi"}]}', {}, "messages[0].role"),
    (PROMPT + b'"prompt": "\\ud800"}', {}, "surrogate"),
    (PROMPT + b'"prompt": "hi", "stop": ["\\udfff"]}', {}, "surrogate"),
    (PROMPT + b'"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, "nested"),
    (b"[" * 100_000 + b"]" * 100_000, {}, "nested"),
    (PROMPT + b'"prompt": "hi", "model": ["a"]}', {}, "model"),
    (PROMPT + b'"prompt": "hi"}', {"X-Request-Id": "r\xe9q"}, "X-Request-Id"),
    (PROMPT + b'"prompt": "hi"}', {"X-Request-Id": "\u20ac".encode()}, "X-Request-Id"),
    (PROMPT + b'"prompt": "hi"}', {"X-Request-Id": "x" * 300}, "X-Request-Id"),
]


@pytest.mark.parametrize("mode", ["plain", "vllm-pd", "sglang-pd"])
def test_bad_bodies_and_headers_are_400_naming_the_field(mode, caplog):
    caplog.set_level(logging.DEBUG)

    async def main():
        engine = "sglang" if mode.startswith("sglang") else "vllm"
        kw = {"plain": 1} if mode == "plain" else {"prefill": 1, "decode": 1}
        async with Harness(engine, **kw) as h:
            for body, headers, field in CASES:
                path = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
                status, out = await aexchange(h.port, request(path, body, headers))
                message = json.loads(out)["error"]["message"]
                assert status == 400 and field in message, (body[:90], headers, out[:300])
            packed = gzip.compress(b'{"prompt": "' + b"a" * (1 << 20) + b'"}')  # never inflated: no bomb
            status, out = await aexchange(h.port, request("/v1/completions", packed, {"Content-Encoding": "gzip"}))
            assert status == 415 and b"Content-Encoding" in out, out[:200]
            assert sum(len(w.requests) for w in h.workers) == 0
            # the same fields, well formed, are served
            good = PROMPT + b'"prompt": "hi", "pdsdk": {"priority": 3, "ttl_s": 5, "session": "s1"}}'
            status, out = await aexchange(h.port, request("/v1/completions", good, {"X-Request-Id": "req-1.a:b"}))
            assert status == 200, out
            chat = PROMPT + b'"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, ' \
                            b'{"type": "image_url", "image_url": {"url": "x"}}]}, ' \
                            b'{"role": "user", "content": null}]}'
            assert (await aexchange(h.port, request("/v1/chat/completions", chat)))[0] == 200
            emoji = PROMPT + b'"prompt": "\\ud83d\\ude00"}'  # a surrogate pair is a character
            assert (await aexchange(h.port, request("/v1/completions", emoji)))[0] == 200
    asyncio.run(main())
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
