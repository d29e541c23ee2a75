"""The parent of a router's serving processes: it keeps the worker set (primary.py), starts the N
serving processes (child.py), starts another when one dies, and on SIGTERM or SIGINT stops them
all (each drains its requests) before it exits. It serves no request itself.

Its private folder (state_dir.py) is removed at exit, or by the next router's start if the parent was
killed. Each process reads the config on its stdin.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import time

import msgspec

from pdsdk.errors import ConfigError
from pdsdk.router.config import RouterConfig
from pdsdk.router.processes.load_table import LoadTable
from pdsdk.router.processes.primary import Primary
from pdsdk.router.processes.state_dir import open_state_dir

log = logging.getLogger("pdsdk.router")
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0  # a process drains for up to 5 s (server.SHUTDOWN_GRACE_S), then is killed
QUICK_EXIT_S = 10.0  # a process that dies sooner than this after its start is restarted ever more slowly


def run(cfg: RouterConfig) -> None:
    cfg.validate()
    state_dir, lock = open_state_dir()
    try:
        asyncio.run(Parent(cfg, state_dir).main())
    except KeyboardInterrupt:
        pass
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
        os.close(lock)


def _reserve(host: str, port: int) -> socket.socket:
    """Bind host:port with SO_REUSEPORT, without listening: it fixes the port (0: any free one) that
    the serving processes then each bind and listen on."""
    why = None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError as e:
        why = e.strerror or str(e)
    else:
        if port and _answers(family, host, port):  # another SO_REUSEPORT server would share our connections
            sock.close()
            why = "a server listens there already"
    if why is not None:
        raise ConfigError("--port", f"cannot listen on {host}:{port} ({why}); pick another --port or stop what "
                                    "listens there")
    return sock


def _answers(family: int, host: str, port: int) -> bool:
    target = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            return s.connect_ex((target, port)) == 0
    except OSError:
        return False


class Parent:
    def __init__(self, cfg: RouterConfig, state_dir: str):
        self.cfg, self.state_dir = cfg, state_dir
        self.n = cfg.processes
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.ready: dict[int, int] = {}  # process index -> pid, once it listens
        self.stopping = False
        self._all_ready = asyncio.Event()

    async def main(self) -> None:
        cfg = self.cfg
        reserved = _reserve(cfg.host, cfg.port) if cfg.listen_fd is None else None
        if reserved is not None:
            cfg.port = reserved.getsockname()[1]
        os.mkdir(os.path.join(self.state_dir, "metrics"))
        self.config = msgspec.json.encode(cfg)  # handed to each process on its stdin: keys stay off the disk
        self.table = LoadTable(os.path.join(self.state_dir, "load"), self.n, None, create=True)
        self.primary = Primary(cfg, self.state_dir, self.table, self._on_ready)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        keepers = []
        try:
            await self.primary.start()
            keepers = [asyncio.ensure_future(self._keep(i)) for i in range(self.n)]
            started, stopped = asyncio.ensure_future(self._all_ready.wait()), asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait([started, stopped, *keepers], timeout=START_TIMEOUT_S,
                                         return_when=asyncio.FIRST_COMPLETED)
            started.cancel()
            stopped.cancel()
            if started not in done:
                failed = [k.exception() for k in done if k in keepers and k.exception() is not None]
                if failed:
                    raise failed[0]
                if not stop.is_set():
                    raise ConfigError("processes", f"the router's processes did not all start in "
                                                   f"{START_TIMEOUT_S:g} s (see their output above)")
            else:
                print(f"pdsdk router on http://{cfg.host}:{cfg.port} ({cfg.describe()}, {self.n} processes)",
                      flush=True)
                await stop.wait()
        finally:
            self.stopping = True
            await self._stop_children()
            for k in keepers:
                k.cancel()
            await asyncio.gather(*keepers, return_exceptions=True)
            await self.primary.stop()
            self.table.close()
            if reserved is not None:
                reserved.close()

    def _on_ready(self, index: int, pid: int) -> None:
        if index in self.procs and self.procs[index].pid == pid:
            if index in self.ready:
                log.warning("router process %d restarted (pid %d)", index, pid)
            self.ready[index] = pid
            if len(self.ready) == self.n:
                self._all_ready.set()

    async def _keep(self, index: int) -> None:
        """Run serving process `index`; start another when it dies (a first start that fails ends the router)."""
        quick = 0
        while True:
            began = time.monotonic()
            proc = self.procs[index] = await self._spawn(index)
            code = await proc.wait()
            if self.stopping:
                return
            if not self._all_ready.is_set():
                raise ConfigError("processes", f"router process {index} exited with {code} while starting")
            self.table.clear_row(index)  # its requests are gone with it
            quick = quick + 1 if time.monotonic() - began < QUICK_EXIT_S else 0
            delay = min(30.0, 0.5 * 2 ** quick) if quick else 0.0
            log.warning("router process %d (pid %d) exited with %s; starting another%s", index, proc.pid, code,
                        f" in {delay:g} s" if delay else "")
            await asyncio.sleep(delay)

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        safe_path = ["-P"] if getattr(sys.flags, "safe_path", False) else []  # as this process was started
        cmd = [sys.executable, *safe_path, "-m", "pdsdk.router.processes.child", self.state_dir, str(index),
               str(os.getpid()), str(logging.getLogger().getEffectiveLevel())]
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": os.path.join(self.state_dir, "metrics")}
        fds = (self.cfg.listen_fd,) if self.cfg.listen_fd is not None else ()
        proc = await asyncio.create_subprocess_exec(*cmd, env=env, pass_fds=fds, stdin=asyncio.subprocess.PIPE)
        proc.stdin.write(self.config)
        await proc.stdin.drain()
        proc.stdin.close()
        return proc

    async def _stop_children(self) -> None:
        live = [p for p in self.procs.values() if p.returncode is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in live)), STOP_GRACE_S)
        except asyncio.TimeoutError:
            for p in live:
                if p.returncode is None:
                    log.warning("router process (pid %d) did not stop in %g s: killed", p.pid, STOP_GRACE_S)
                    p.kill()
            await asyncio.gather(*(p.wait() for p in live))

