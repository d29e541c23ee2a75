"""`pdsdk router --processes N`: the processes share one port, one worker set, their in-flight
counts and their metrics; SIGTERM drains them all; a dead one is replaced.

Real router processes on loopback, fake workers in this test's event loop. Which router process
sent a request is read from the connection it came on (the worker's peer port, owned by one pid).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import threading

import aiohttp
import psutil
import pytest
from helpers import pdsdk_cli
from kvevents import BS, endpoints, publish
from pdsdk.ports import free_port
from pdsdk.router.processes.load_table import LoadTable
from pdsdk.testing import fake_kv_events as fe
from pdsdk.testing.fake_worker import FakeWorker

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 2}


class Router:
    """`pdsdk router --processes N ARGS...` in a child process of the test."""

    def __init__(self, *args: str, processes: int = 2):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([pdsdk_cli(), "router", "--processes", str(processes), "--port", str(self.port),
                                      "--health-interval", "0.5", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd="/")
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    async def started(self, timeout: float = 60) -> Router:
        """Wait (without blocking the workers' event loop) for the line printed once every process listens."""
        assert await until(lambda: any("pdsdk router on" in x for x in self.lines) or self.proc.poll() is not None,
                           timeout), self.lines
        assert self.proc.poll() is None, "".join(self.lines)
        return self

    def children(self) -> set[int]:
        return {c.pid for c in psutil.Process(self.proc.pid).children()}

    async def stop(self) -> int:
        """SIGTERM, and its exit status (waited for in a thread: the workers' event loop keeps serving)."""
        return await asyncio.to_thread(self._stop)

    def _stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


async def until(check, timeout: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if check():
            return True
        await asyncio.sleep(0.05)
    return bool(check())


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for its reaper counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def senders(router: Router, worker: FakeWorker) -> set[int]:
    """The router processes whose connections carried the requests `worker` received."""
    ports = {r["peer"][1] for r in worker.requests}
    return {pid for pid in router.children() for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.raddr and c.raddr.port == worker.port and c.laddr.port in ports}


async def send(url: str, n: int, body=BODY, headers=None, path: str = "/v1/completions") -> list:
    """n requests, each on a new connection (so the kernel spreads them over the processes)."""
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        for _ in range(n):
            async with s.request("POST" if body is not None else "GET", url + path, json=body,
                                 headers=headers or {}) as r:
                out.append((r.status, await r.json(content_type=None) if path != "/metrics" else await r.text()))
    return out


async def workers(n: int, **opts) -> list[FakeWorker]:
    return [await FakeWorker(**opts).start() for _ in range(n)]


def run(coro):
    return asyncio.run(coro)


# --- fast: the shared table and the option -----------------------------------------------------

def test_load_table_sums_the_rows_each_process_writes(tmp_path):
    path = str(tmp_path / "load")
    reader = LoadTable(path, 2, None, create=True)
    a, b = LoadTable(path, 2, 0), LoadTable(path, 2, 1)
    a.add(7, 1), b.add(7, 1), b.add(7, 1), a.add(8, 1), a.add(8, -1)
    assert (reader.total(7), reader.total(8), reader.total(9)) == (3, 0, 0)
    b.set_breaker(7, "open"), a.set_breaker(7, "half-open")
    assert reader.breaker(7) == "open" and reader.breaker(8) == "closed"
    reader.clear_row(1)  # process 1 died: its requests and breakers are gone
    assert reader.total(7) == 1 and reader.breaker(7) == "half-open"
    for t in (a, b, reader):
        t.close()


def test_processes_option_and_its_environment_default(monkeypatch):
    from pdsdk.cli import build_parser
    from pdsdk.cli.router import config_from_args
    from pdsdk.errors import ConfigError

    parse = build_parser().parse_args
    assert config_from_args(parse(["router", "--processes", "3"])).processes == 3
    monkeypatch.setenv("PDSDK_ROUTER_PROCESSES", "1")
    assert config_from_args(parse(["router"])).processes == 1
    monkeypatch.delenv("PDSDK_ROUTER_PROCESSES")
    assert 1 <= config_from_args(parse(["router"])).processes <= 8
    for bad in ("0", "65"):
        with pytest.raises(ConfigError, match="processes"):
            config_from_args(parse(["router", "--processes", bad])).validate()
    monkeypatch.setenv("PDSDK_ROUTER_PROCESSES", "many")
    with pytest.raises(ConfigError, match="PDSDK_ROUTER_PROCESSES"):
        config_from_args(parse(["router"]))


def test_a_port_another_server_listens_on_is_refused_not_shared():
    """SO_REUSEPORT would let a second router join the first one's port and take half its clients."""
    import socket

    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        out = subprocess.run([pdsdk_cli(), "router", "--processes", "2", "--port", str(other.getsockname()[1]),
                              "--worker", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 2 and "--port" in out.stderr and "listens there already" in out.stderr, out.stderr


# --- slow: real processes -------------------------------------------------------------------------

@pytest.mark.slow
def test_a_worker_added_through_the_admin_api_gets_requests_from_every_process():
    async def main():
        first, added = await workers(2)
        r = await Router("--worker", first.url, "--policy", "round_robin").started()
        try:
            status, = {s for s, _ in await send(r.url, 1, {"url": added.url}, path="/admin/workers")}
            assert status == 201
            # every process lists it, whichever takes the question
            listed = await send(r.url, 8, None, path="/admin/workers")
            assert all(added.url in [w["url"] for w in body["workers"]] for _, body in listed)
            assert all(s == 200 for s, _ in await send(r.url, 40))
            assert len(added.requests) >= 10 and senders(r, added) == r.children(), (senders(r, added), r.children())
        finally:
            assert await r.stop() == 0
    run(main())


@pytest.mark.slow
def test_one_scrape_of_metrics_counts_every_process_and_sessions_stick_across_processes():
    async def main():
        ws = await workers(3)
        r = await Router(*[a for w in ws for a in ("--worker", w.url)], "--policy", "session").started()
        try:
            assert all(s == 200 for s, _ in await send(r.url, 30, headers={"X-Session-Id": "alice"}))
            holder = [w for w in ws if w.requests]
            assert len(holder) == 1 and senders(r, holder[0]) == r.children()  # one worker, from both processes
            for _, text in await send(r.url, 6, None, path="/metrics"):
                got = re.search(r'pdsdk_router_requests_total\{outcome="200",route="completions"\} (\S+)', text)
                assert got and float(got.group(1)) == 30, text[-2000:]
        finally:
            await r.stop()
    run(main())


@pytest.mark.slow
def test_kv_events_routes_every_prompt_to_the_holder_whichever_process_takes_it():
    async def main():
        ws = await workers(2)
        eps = [endpoints() for _ in ws]
        pubs = [fe.Publisher(*ep) for ep in eps]
        prompts = [list(range(i * 100, i * 100 + 4 * BS)) for i in range(8)]
        for p in prompts:  # before the router starts: each process reads them from the replay buffer
            publish(pubs[1], "vllm", p)
        args = [a for w, (events, replay) in zip(ws, eps)
                for a in ("--worker", w.url, "--kv-events", f"{w.url}={events}", "--kv-replay", f"{w.url}={replay}")]
        r = await Router(*args, "--policy", "kv_events").started()
        try:
            assert await until_indexed_everywhere(r.url, 8 * 4)
            for p in prompts:
                assert all(s == 200 for s, _ in await send(r.url, 3, {"model": "fake-model", "prompt": p,
                                                                      "max_tokens": 1}))
            assert len(ws[1].requests) == 24 and not ws[0].requests
            assert senders(r, ws[1]) == r.children()
        finally:
            await r.stop()
            for p in pubs:
                p.close()
    run(main())


async def until_indexed_everywhere(url: str, blocks: int, timeout: float = 20) -> bool:
    """Every process's kv_events index holds `blocks` blocks (asked over new connections until all say so)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        answers = await send(url, 8, None, path="/admin/policies")
        if all(sum(body["plain"]["blocks"].values()) >= blocks for _, body in answers):
            return True
        await asyncio.sleep(0.1)
    return False


async def slow_stream(url: str, tokens: int = 60) -> asyncio.Task:
    """A streamed request that stays in flight (the workers pace their tokens) until cancelled or done."""
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={**BODY, "max_tokens": tokens, "stream": True}) as r:
                assert r.status == 200
                return await r.read()
    return asyncio.ensure_future(go())


@pytest.mark.slow
def test_least_load_counts_what_every_process_has_in_flight():
    async def main():
        ws = await workers(2, chunks=200, token_delay_s=0.05)
        r = await Router(*[a for w in ws for a in ("--worker", w.url)], "--policy", "least_load").started()
        try:
            slow = await slow_stream(r.url)
            assert await until(lambda: sum(len(w.requests) for w in ws) == 1)
            busy, idle = ws if ws[0].requests else ws[::-1]
            assert all(s == 200 for s, _ in await send(r.url, 20, {**BODY, "max_tokens": 1}))
            assert len(busy.requests) == 1 and len(idle.requests) == 20
            assert senders(r, idle) == r.children()  # the process without the slow request saw it too
            slow.cancel()
            await asyncio.gather(slow, return_exceptions=True)
        finally:
            await r.stop()
    run(main())


@pytest.mark.slow
def test_a_drained_worker_drains_in_every_process_and_leaves_when_all_its_requests_end():
    async def main():
        ws = await workers(2, chunks=200, token_delay_s=0.05)
        r = await Router(*[a for w in ws for a in ("--worker", w.url)], "--policy", "round_robin").started()
        try:
            slow = await slow_stream(r.url, tokens=100)  # 5 s
            assert await until(lambda: sum(len(w.requests) for w in ws) == 1)
            busy, idle = ws if ws[0].requests else ws[::-1]
            (status, body), = await send(r.url, 1, {"url": busy.url}, path="/admin/workers/drain")
            assert status == 200 and body["draining"] and body["in_flight"] == 1
            assert all(s == 200 for s, _ in await send(r.url, 20, {**BODY, "max_tokens": 1}))
            assert len(busy.requests) == 1 and senders(r, idle) == r.children()
            listed = await send(r.url, 6, None, path="/admin/workers")  # still there, every process says
            assert all({w["url"]: (w["draining"], w["in_flight"]) for w in b["workers"]}[busy.url] == (True, 1)
                       for _, b in listed)
            await slow  # it ends normally: the drain waited for it, then the worker leaves every process
            for _ in range(50):
                listed = await send(r.url, 6, None, path="/admin/workers")
                if all([w["url"] for w in b["workers"]] == [idle.url] for _, b in listed):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(listed)
        finally:
            await r.stop()
    run(main())


@pytest.mark.slow
def test_sigterm_drains_every_process_and_leaves_none_behind():
    async def main():
        w, = await workers(1, chunks=200, token_delay_s=0.05)
        r = await Router("--worker", w.url).started()
        children = r.children()
        state_dir = psutil.Process(min(children)).cmdline()[-4]
        assert len(children) == 2 and os.path.isdir(state_dir)
        slow = await slow_stream(r.url, tokens=20)  # 1 s
        assert await until(lambda: len(w.requests) == 1)
        r.proc.send_signal(signal.SIGTERM)
        assert (await slow).count(b"data: ") == 21  # served to its end, [DONE] included
        assert await until(lambda: r.proc.poll() is not None, 15) and r.proc.returncode == 0
        assert all(gone(p) for p in children) and not os.path.exists(state_dir)
    run(main())


@pytest.mark.slow
def test_serving_processes_die_with_a_killed_parent_and_the_next_router_clears_its_folder():
    async def main():
        w, = await workers(1)
        r = await Router("--worker", w.url).started()
        children = r.children()
        state_dir = psutil.Process(min(children)).cmdline()[-4]
        r.proc.kill()
        r.proc.wait(5)
        assert await until(lambda: all(gone(p) for p in children), 10)
        assert os.path.isdir(state_dir)  # nobody was left to remove it
        again = await Router("--worker", w.url).started()
        try:
            assert not os.path.exists(state_dir)
        finally:
            assert await again.stop() == 0
    run(main())


def test_only_unlocked_router_folders_of_this_user_are_removed(tmp_path):
    """A live router is told by its lock, not its pid: containers sharing /dev/shm do not share pids."""
    from pdsdk.router.processes.state_dir import open_state_dir, remove_stale

    live, held = open_state_dir(str(tmp_path))
    stale, gone = open_state_dir(str(tmp_path))
    os.mkdir(os.path.join(stale, "metrics"))
    os.close(gone)  # its router died: the lock is let go
    unlocked = tmp_path / "pdsdk-router-older"  # no lock file: being made, or an older router's
    unlocked.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "lock").touch()
    (tmp_path / "pdsdk-router-link").symlink_to(target)
    assert remove_stale(str(tmp_path)) == [stale]
    assert os.path.isdir(live) and unlocked.is_dir() and (target / "lock").exists()
    assert os.stat(live).st_mode & 0o777 == 0o700
    os.close(held)  # the live router dies: its folder goes with the next start
    assert remove_stale(str(tmp_path)) == [live]


@pytest.mark.slow
def test_a_killed_process_is_replaced_and_catches_up():
    async def main():
        first, added = await workers(2)
        r = await Router("--worker", first.url, "--policy", "round_robin").started()
        try:
            assert (await send(r.url, 1, {"url": added.url}, path="/admin/workers"))[0][0] == 201
            before = r.children()
            victim = min(before)
            os.kill(victim, signal.SIGKILL)
            assert await until(lambda: len(r.children()) == 2 and victim not in r.children(), 20)
            assert await until(lambda: any("router process" in x and "restarted" in x for x in r.lines), 20), r.lines
            assert all(s == 200 for s, _ in await send(r.url, 40))
            assert senders(r, added) == r.children()  # the new process has the admin-added worker too
        finally:
            assert await r.stop() == 0
    run(main())
