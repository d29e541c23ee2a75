"""`pdsdk router` on the command line, and etcd discovery against a real etcd server."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time

import aiohttp
import pytest
from helpers import pdsdk_cli

from pdsdk.cli import build_parser
from pdsdk.ports import free_port
from pdsdk.router.etcd import Registration
from pdsdk.testing.fake_worker import FakeWorker
from pdsdk.testing.router_harness import Harness, eventually


def test_every_router_option_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["router"]
    opts = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert len(opts) >= 25
    missing = [a.option_strings[0] for a in opts if not (a.help or "").strip()]
    assert not missing
    names = {s for a in opts for s in a.option_strings}
    assert {"--host", "--port", "--engine", "--worker", "--prefill", "--decode", "--policy",
            "--prefill-policy", "--decode-policy"} <= names
    args = parser.parse_args(["router", "--prefill", "http://p:1", "8998", "--prefill", "http://q:1",
                              "--decode", "http://d:1", "--policy-option", "prefix.cache_threshold=0.5"])
    from pdsdk.cli.router import config_from_args
    cfg = config_from_args(args)
    assert cfg.prefill == ["http://p:1 8998", "http://q:1"] and cfg.host == "127.0.0.1"
    assert cfg.policy_options == {"prefix": {"cache_threshold": 0.5}}


def test_cli_serves_requests():
    async def main():
        w = await FakeWorker().start()
        port = free_port()
        proc = subprocess.Popen([pdsdk_cli(), "router", "--port", str(port), "--worker", w.url,
                                 "--policy", "prefix"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd="/")
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(200):
                    try:
                        async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                                          json={"model": "fake-model", "prompt": "hi", "max_tokens": 2}) as r:
                            assert r.status == 200 and (await r.json())["choices"][0]["text"] == "tok0 tok1"
                            break
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.05)
                else:
                    raise AssertionError(proc.stdout.read1().decode())
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(10) == 0
            await w.stop()
    asyncio.run(main())


@pytest.fixture
def etcd_server(tmp_path):
    exe = shutil.which("etcd")
    if exe is None:
        pytest.skip("etcd is not installed (apt install etcd-server)")
    port, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([exe, "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", url,
                             "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "ETCD_NAME": "default"})
    deadline = time.monotonic() + 20
    import urllib.request
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=0.5)
            break
        except OSError:
            time.sleep(0.1)
    yield url
    proc.kill()
    proc.wait()


@pytest.mark.slow
def test_etcd_workers_join_and_leave_on_their_own(etcd_server):
    async def main():
        async with Harness("vllm", prefill=1, decode=1, etcd=etcd_server) as h:
            extra = await FakeWorker("vllm", "decode").start()
            reg = await Registration(etcd_server, {"url": extra.url, "role": "decode"}, ttl_s=2).start()
            assert await eventually(lambda: extra.url in h.router.pool.workers, 5)
            assert h.router.pool.workers[extra.url].source == "etcd"
            await reg.stop(revoke=True)  # clean leave
            assert await eventually(lambda: extra.url not in h.router.pool.workers, 5)
            reg = await Registration(etcd_server, {"url": extra.url, "role": "decode"}, ttl_s=2).start()
            assert await eventually(lambda: extra.url in h.router.pool.workers, 5)
            await reg.stop(revoke=False)  # the worker dies: its lease runs out
            assert await eventually(lambda: extra.url not in h.router.pool.workers, 8)
            for _ in range(3):
                assert (await h.post("/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": 1}))[0] == 200
            await extra.stop()
    asyncio.run(main())
