"""The launcher keeps a served deployment up: real processes (fake vLLM workers and the real router)
killed, hung and killed again, under the Supervisor that `pdsdk launch` runs."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import sys
import threading
import time
import urllib.request

import pytest
from helpers import eventually
from rich.console import Console

from pdsdk import ConfigError
from pdsdk.launch.plan import LaunchPlan, ProcessSpec
from pdsdk.launch.restart import RestartPolicy
from pdsdk.launch.supervisor import ChildDied, Supervisor
from pdsdk.ports import free_port
from pdsdk.router.config import RouterConfig
from pdsdk.router.server import start

BODY = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}


def fake(name: str, role: str) -> ProcessSpec:
    port = free_port()
    cmd = [sys.executable, "-m", "pdsdk.testing.fake_worker", "--port", str(port), "--role", role]
    return ProcessSpec(name, role, cmd, port=port)


def deployment() -> LaunchPlan:
    workers = [fake("prefill-0", "prefill"), fake("decode-0", "decode"), fake("decode-1", "decode")]
    port = free_port()
    cmd = [sys.executable, "-m", "pdsdk", "router", "--port", str(port), "--health-interval", "0.3"]
    for w in workers:
        cmd += [f"--{w.role}", w.url]
    router = ProcessSpec("router", "router", cmd, port=port, live_path="/live", listen=True)
    return LaunchPlan("vllm", "m", "fake-model", {}, workers, router, "127.0.0.1", [workers])


class Running:
    """A supervised deployment, watched in a thread; what the console printed, and how watch() ended."""

    def __init__(self, tmp_path, policy: RestartPolicy):
        self.out = io.StringIO()
        self.plan = deployment()
        self.sup = Supervisor(self.plan, tmp_path, Console(file=self.out, width=300), echo=False, restart=policy)
        self.ended: BaseException | None = None
        self.sup.start(self.plan.workers)
        self.sup.wait_healthy(self.plan.workers, 30)
        self.sup.start([self.plan.router])
        self.sup.wait_healthy([self.plan.router], 30)
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        try:
            self.sup.watch()
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            self.ended = e

    def status(self) -> dict:
        return json.loads((self.sup.log_dir / "status.json").read_text())["processes"]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        os.killpg(self.sup.procs[name].pid, sig)

    def complete(self, timeout: float = 10) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.plan.router.port}/v1/completions",
                                     data=json.dumps(BODY).encode(), headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=timeout).read())

    def stop(self) -> None:
        self.sup.stop()
        self.thread.join(10)


@pytest.mark.slow  # ~10 s of real restarts: the full suite
def test_dead_hung_and_router_processes_are_restarted_on_their_ports(tmp_path):
    run = Running(tmp_path, RestartPolicy(unhealthy_s=1.5, backoff_s=0.2))
    try:
        old = run.sup.procs["decode-0"].pid
        run.kill("decode-0")
        assert eventually(lambda: run.status()["decode-0"]["state"] == "healthy" and
                          run.status()["decode-0"]["restarts"] == 1, 20), run.out.getvalue()
        assert run.sup.procs["decode-0"].pid != old
        out = run.out.getvalue()
        assert "restart: decode-0 (decode, port" in out and "killed by SIGKILL" in out, out
        assert "decode-0 is healthy again" in out
        assert run.complete()["choices"][0]["text"]

        run.kill("prefill-0", signal.SIGSTOP)  # hung: alive, not answering
        assert eventually(lambda: run.status()["prefill-0"]["restarts"] == 1, 20), run.out.getvalue()
        assert "failed its health check for" in run.status()["prefill-0"]["last_exit"]
        assert eventually(lambda: run.status()["prefill-0"]["state"] == "healthy", 20)

        run.kill("router")
        time.sleep(0.1)  # down: the request waits in the launcher's backlog for the new router
        assert run.complete(timeout=30)["choices"][0]["text"]
        assert eventually(lambda: run.status()["router"]["restarts"] == 1 and
                          run.status()["router"]["state"] == "healthy", 20)
        assert run.ended is None
    finally:
        run.stop()
    assert all(p.poll() is not None for p in run.sup.procs.values())


@pytest.mark.slow
def test_the_launcher_gives_up_after_max_restarts_naming_the_worker(tmp_path):
    run = Running(tmp_path, RestartPolicy(max_restarts=1, backoff_s=0.1))
    try:
        run.kill("decode-1")
        assert eventually(lambda: run.status()["decode-1"]["state"] == "healthy" and
                          run.status()["decode-1"]["restarts"] == 1, 20)
        run.kill("decode-1")
        run.thread.join(20)
        assert isinstance(run.ended, ChildDied) and run.ended.name == "decode-1"
        assert "gave up after 1 restarts in a row (--max-restarts 1)" in str(run.ended)
        assert "fake worker on" in str(run.ended)  # its last lines
    finally:
        run.stop()


@pytest.mark.slow  # a few seconds of subprocesses: the full suite
def test_restart_never_stops_at_the_first_death_and_bad_options_are_named(tmp_path):
    run = Running(tmp_path, RestartPolicy(mode="never"))
    try:
        run.kill("prefill-0")
        run.thread.join(20)
        assert isinstance(run.ended, ChildDied) and "not restarted (--restart never)" in str(run.ended)
    finally:
        run.stop()
    with pytest.raises(ConfigError, match="--restart"):
        RestartPolicy(mode="sometimes")
    with pytest.raises(ConfigError, match="--max-restarts"):
        RestartPolicy(max_restarts=-1)
    assert [RestartPolicy(backoff_s=1).delay(n) for n in (0, 1, 2, 10)] == [1, 2, 4, 60]
    r, w = os.pipe()
    try:  # the router's --listen-fd takes a listening TCP socket, nothing else
        with pytest.raises(ConfigError, match="--listen-fd"):
            asyncio.run(start(RouterConfig(listen_fd=r)))
    finally:
        os.close(r)
        os.close(w)
    assert not RestartPolicy().restarts(0) and RestartPolicy().restarts(-9) and RestartPolicy("always").restarts(0)
