"""Fuzz: admin calls (bodies, query, Host and Origin) against a real router on loopback. Never a
5xx or a traceback; a refused call leaves the workers as they were; a cross-site call is refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rawhttp import LiveRouter, exchange, request

from pdsdk.router.admin import _is_own_host

pytestmark = pytest.mark.slow  # the fuzz tier: `make test`, about 15-30 s for the router's part
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))

text = st.text(st.characters(codec=None, exclude_categories=()), max_size=30)
header_text = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=30) | st.binary(
    max_size=30).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"").decode("utf-8", "surrogateescape"))
scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | text
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) |
                           st.dictionaries(text, inner, max_size=3), max_leaves=8)
urls = st.builds(lambda scheme, host, port: f"{scheme}://{host}{port}",
                 st.sampled_from(["http", "https", "ftp", ""]),
                 st.sampled_from(["127.0.0.1", "[::1]", "[::1", "localhost", "", "a b", "10.0.0.5"]),
                 st.sampled_from(["", ":1", ":0", ":65535", ":65536", ":99999", ":-1", ":x", ":18030"]))
fields = {"url": urls | json_values, "role": st.sampled_from(["plain", "prefill", "decode", "", "x"]) | json_values,
          "bootstrap_port": st.integers(-5, 70000) | json_values, "kv_events": text | json_values,
          "kv_replay": text | json_values, "remove": st.booleans() | json_values}
bodies = st.fixed_dictionaries({}, optional=fields) | json_values
hosts = st.sampled_from(["127.0.0.1", "localhost:8000", "[::1]:1", "evil.example", "evil.example:8000",
                         "127.0.0.1.evil.example", "localhost.", "", "[::1"]) | header_text
origins = st.none() | st.sampled_from(["null", "http://evil.example", "http://127.0.0.1:8000", "file://",
                                       "http://localhost"]) | header_text


@pytest.fixture(scope="module")
def router():
    with LiveRouter(plain=1, read_timeout_s=1.0) as r:
        yield r
        assert not r.log.tracebacks(), r.log.tracebacks()[:5]


def restore(r: LiveRouter, before: dict) -> None:
    """Put the pool back as it was after a call that was accepted (an add, a drain, a removal)."""
    def put_back(h):
        pool = h.router.pool
        for url in [u for u in pool.workers if u not in before]:
            pool.remove(url)
        for fw in h.workers:
            w = pool.get(fw.url)
            if w is None:
                from pdsdk.router.workers import Worker

                h.router.add_worker(Worker(fw.url))
            else:
                w.draining = False
    r.call(put_back)


@FUZZ
@given(body=bodies, path=st.sampled_from(["/admin/workers", "/admin/workers/drain"]), method=st.sampled_from(
    ["POST", "DELETE"]), raw_json=st.booleans())
def test_admin_bodies(router, body, path, method, raw_json):
    before = router.workers()
    data = json.dumps(body, allow_nan=True).encode() if raw_json else json.dumps(body, allow_nan=True)[:-1].encode()
    status, out = exchange(router.port, request(path, data, {}, method))
    assert 200 <= status < 500, (status, body, out[:300])
    if status >= 400:
        assert router.workers() == before, (status, body, out[:300])
    else:
        restore(router, before)


@FUZZ
@given(host=hosts, origin=origins, content_type=st.sampled_from(["application/json", "text/plain",
                                                                 "application/x-www-form-urlencoded", ""]))
def test_admin_cross_site(router, host, origin, content_type):
    before = router.workers()
    h = {"Host": host.encode("utf-8", "surrogateescape"), "Content-Type": content_type}
    if origin is not None:
        h["Origin"] = origin.encode("utf-8", "surrogateescape")
    body = json.dumps({"url": "http://127.0.0.1:18030"}).encode()
    raw = request("/admin/workers", body, h).replace(b"Host: 127.0.0.1\r\n", b"", 1)
    status, out = exchange(router.port, raw)
    assert 200 <= status < 500, (status, h, out[:300])
    if status < 400:
        assert _is_own_host(host, "127.0.0.1") and content_type == "application/json", (h, status)
        restore(router, before)
    else:
        assert router.workers() == before
