"""The admin API against hostile callers: cross-site requests on loopback (a web page, DNS
rebinding), bad bodies and keys. Every refusal is a 4xx naming the field and leaves the workers
as they were."""

from __future__ import annotations

import asyncio

import pytest
from rawhttp import aexchange, request

from pdsdk.testing.router_harness import Harness


def run(coro):
    return asyncio.run(coro)


def workers(h: Harness) -> dict:
    return {url: (w.role, w.bootstrap_port, w.draining) for url, w in h.router.pool.workers.items()}


async def raw_post(h: Harness, path: str, data: bytes, headers: dict) -> tuple[int, str]:
    async with h.session.post(h.url + path, data=data, headers=headers) as r:
        return r.status, await r.text()


def test_a_web_page_cannot_add_or_drain_workers_on_loopback():
    """The reproduction: a "simple" cross-origin POST (text/plain) with a foreign Host and Origin
    added a worker (which then got the prompts and the worker key); a drain took the only one out."""
    async def main():
        async with Harness(plain=1) as h:
            before = workers(h)
            evil = {"Host": "evil.example", "Origin": "http://evil.example"}
            add = b'{"url": "http://127.0.0.1:18030"}'
            for headers in ({**evil, "Content-Type": "text/plain"},  # what a page sends without CORS
                            {**evil, "Content-Type": "application/json"},
                            {"Host": "evil.example:8000", "Content-Type": "application/json"},  # DNS rebinding
                            {"Origin": "http://evil.example", "Content-Type": "application/json"},
                            {"Origin": "null", "Content-Type": "application/json"},
                            {"Content-Type": "text/plain"}):  # same host, but not JSON
                status, text = await raw_post(h, "/admin/workers", add, headers)
                assert status in (403, 415), (headers, status, text)
                status, text = await raw_post(h, "/admin/workers/drain", f'{{"url": "{h.plain[0].url}"}}'.encode(),
                                              headers)
                assert status in (403, 415), (headers, status, text)
            assert workers(h) == before
            async with h.session.get(h.url + "/admin/workers", headers=evil) as r:
                assert r.status == 403 and "Host" in (await r.json())["error"]["message"]
            async with h.session.delete(h.url + "/admin/workers", params={"url": h.plain[0].url},
                                        headers={"Host": "evil.example"}) as r:
                assert r.status == 403
            assert workers(h) == before
            # the router's own names still work: loopback addresses and localhost, with their ports
            for host in (f"127.0.0.1:{h.port}", f"localhost:{h.port}", "[::1]", "127.0.0.2"):
                status, text = await raw_post(h, "/admin/workers/drain", f'{{"url": "{h.plain[0].url}", '
                                              f'"remove": false}}'.encode(),
                                              {"Host": host, "Origin": f"http://{host}",
                                               "Content-Type": "application/json; charset=utf-8"})
                assert status == 200, (host, text)
    run(main())


def test_with_an_admin_key_the_key_decides():
    async def main():
        async with Harness(plain=1, admin_key="k") as h:
            ok = {"Authorization": "Bearer k", "Host": "router.internal:8000"}
            async with h.session.get(h.url + "/admin/workers", headers=ok) as r:
                assert r.status == 200
            status, _ = await raw_post(h, "/admin/workers", b'{"url": "http://127.0.0.1:9"}',
                                       {**ok, "Content-Type": "text/plain"})
            assert status == 415
    run(main())


def test_a_key_that_is_not_utf8_is_refused_not_a_server_error():
    async def main():
        async with Harness(plain=1, admin_key="k", api_key="c") as h:
            not_utf8 = {"Authorization": b"Bearer \xff\xfe\xc3"}
            for path, method in (("/admin/workers", "POST"), ("/admin/workers", "GET"), ("/v1/completions", "POST")):
                status, body = await aexchange(h.port, request(path, b"{}", not_utf8, method))
                assert status == 401, (path, status, body)
    run(main())


BAD_BODIES = [
    (b'{"url": 5}', "url"),
    (b'{"url": [1]}', "url"),
    (b'{"url": null}', "url"),
    (b'{}', "url"),
    (b'{"url": "http://127.0.0.1:99999"}', "url"),
    (b'{"url": "http://[::1"}', "url"),
    (b'{"url": "http://127.0.0.1:9", "bootstrap_port": "abc"}', "bootstrap_port"),
    (b'{"url": "http://127.0.0.1:9", "bootstrap_port": 70000}', "bootstrap_port"),
    (b'{"url": "http://127.0.0.1:9", "bootstrap_port": true}', "bootstrap_port"),
    (b'{"url": "http://127.0.0.1:9", "role": 5}', "role"),
    (b'{"url": "http://127.0.0.1:9", "role": ["plain"]}', "role"),
    (b'{"url": "http://127.0.0.1:9", "kv_events": 7}', "kv_events"),
    (b'[1, 2]', "object"),
    (b'{"url": ', "JSON"),
    (b'[' * 30_000 + b']' * 30_000, "JSON"),
]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_bad_admin_bodies_are_400_naming_the_field(engine):
    async def main():
        kw = {"plain": 1} if engine == "vllm" else {"prefill": 1, "decode": 1}
        async with Harness(engine, **kw) as h:
            before = workers(h)
            json_ct = {"Content-Type": "application/json"}
            for body, field in BAD_BODIES:
                if engine == "sglang" and b'"http://127.0.0.1:9"' in body and b"role" not in body:
                    body = body.replace(b"{", b'{"role": "prefill", ', 1)  # PD mode needs a role
                status, text = await raw_post(h, "/admin/workers", body, json_ct)
                assert status == 400 and field in text, (body[:60], status, text)
            drain_remove = b'{"url": "%s", "remove": "yes"}' % h.workers[0].url.encode()
            for body in (b'{"url": 5}', b'{"url": ["x"]}', drain_remove):
                status, text = await raw_post(h, "/admin/workers/drain", body, json_ct)
                assert status == 400, (body, status, text)
            async with h.session.delete(h.url + "/admin/workers", json={"url": {"a": 1}}) as r:
                assert r.status == 400
            assert workers(h) == before
    run(main())
