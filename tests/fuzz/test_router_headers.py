"""Fuzz: request heads (any bytes in header names and values, broken request lines, framing)
against a real router on loopback. The answer is never a 5xx, never missing, and nothing is logged
with a traceback."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rawhttp import LiveRouter, exchange, request

pytestmark = pytest.mark.slow  # the fuzz tier: `make test`, about 15-30 s for the router's part
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
BODY = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 2}'
NAMES = ["X-Request-Id", "X-Request-Timeout", "X-Pdsdk-Priority", "X-Pdsdk-Ttl", "X-Pdsdk-Pin", "X-Pdsdk-Session",
         "X-Session-Id", "X-Pdsdk-Keep", "Authorization", "X-Api-Key", "Content-Type", "Host", "Origin", "Expect",
         "Accept-Encoding", "Content-Encoding"]
value = st.binary(max_size=60).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")) | st.sampled_from(
    [b"0", b"-1", b"nan", b"inf", b"1e400", b"0.001", b"\xff\xfe", "\u20ac".encode(), b"a" * 9000, b"100-continue",
     b"gzip", b"Bearer \xc3\x28"])
headers = st.dictionaries(st.sampled_from(NAMES) | st.binary(min_size=1, max_size=20).map(
    lambda b: b.replace(b"\r", b"").replace(b"\n", b"").replace(b":", b"") or b"X"), value, max_size=6)


@pytest.fixture(scope="module")
def router():
    with LiveRouter(plain=1, policy="session", api_key=None, read_timeout_s=1.0) as r:
        yield r
        assert not r.log.tracebacks(), r.log.tracebacks()[:5]


@FUZZ
@given(h=headers, path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/admin/workers", "/v1/models"]))
def test_router_headers(router, h, path):
    body = BODY if path != "/v1/chat/completions" else b'{"model": "fake-model", "messages": [{"role": "user", ' \
                                                            b'"content": "hi"}], "max_tokens": 2}'
    before = router.workers()
    status, out = exchange(router.port, request(path, body, h, "GET" if path == "/v1/models" else "POST"))
    assert 200 <= status < 500, (status, h, out[:300])
    if path == "/admin/workers" and status >= 400:
        assert router.workers() == before


@FUZZ
@given(line=st.binary(max_size=80), rest=st.binary(max_size=200))
def test_router_request_lines_and_raw_heads(router, line, rest):
    status, out = exchange(router.port, line + b"\r\n" + rest + b"\r\nConnection: close\r\n\r\n", timeout=5)
    assert status == 0 or 200 <= status < 500, (status, line, rest, out[:300])  # 0: closed without an answer


@settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(declared=st.sampled_from([b"0", b"5", b"-1", b"abc", b"99999999999999999999", b"10000000000"]),
       chunked=st.booleans(), sent=st.integers(0, 80))
def test_router_body_framing(router, declared, chunked, sent):
    """Lengths that lie, chunked framing, bodies cut short: an answer (or a close) within the
    read timeout, never a server error."""
    h = {"Transfer-Encoding": "chunked"} if chunked else {"Content-Length": declared}
    status, out = exchange(router.port, request("/v1/completions", BODY[:sent], h), timeout=5)
    assert status == 0 or 200 <= status < 500, (status, declared, chunked, sent, out[:300])
