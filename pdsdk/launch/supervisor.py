"""Start the planned processes, stream their logs with a prefix, wait for health with a live
display, keep them up, and stop everything cleanly.

Before the service is ready, any child that dies stops everything (a bad flag or a missing model:
starting it again would not help). Once it is ready, `watch()` starts a process that exits or stays
unhealthy again on its port, with backoff (restart.py), and gives up after too many in a row.
Every child runs in its own process group, so stopping it stops what it started too (vLLM's
EngineCore and workers): no orphans, ports freed. `<log-dir>/status.json` shows each process's
state and restart count.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from pdsdk.errors import ConfigError, PdsdkError
from pdsdk.launch.plan import LaunchPlan, ProcessSpec
from pdsdk.launch.restart import Child, RestartPolicy, exit_reason

COLORS = ("cyan", "magenta", "green", "yellow", "blue", "red")
STOP_GRACE_S = 20
PROBE_EVERY_S = 2.0
PROBE_TIMEOUT_S = 5.0  # a busy engine on shared cores answers slowly; --unhealthy-timeout decides


class ChildDied(PdsdkError):
    def __init__(self, name: str, code: int, tail: list[str], why: str = ""):
        self.name, self.code, self.tail = name, code, tail
        lines = "\n".join(f"  {line}" for line in tail)
        super().__init__(f"{name} exited with code {code} ({exit_reason(code)}){'; ' + why if why else ''}; "
                         f"its last lines:\n{lines}")


class Supervisor:
    def __init__(self, plan: LaunchPlan, log_dir: Path, console: Console | None = None, echo: bool = True,
                 restart: RestartPolicy | None = None):
        self.plan = plan
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.console = console or Console()
        self.echo = echo
        self.policy = restart or RestartPolicy()
        self.children: dict[str, Child] = {}
        self.tails: dict[str, collections.deque] = {}
        self._sockets: dict[str, socket.socket] = {}  # listening sockets held for `listen` specs
        self._threads: list[threading.Thread] = []
        self._lock = threading.RLock()  # a restart and stop() never interleave (stop may run inside a restart: Ctrl-C)
        self.stopping = threading.Event()
        if plan.ipc_dir:  # the workers' KV event sockets: this user's only
            os.makedirs(plan.ipc_dir, mode=0o700, exist_ok=True)

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {name: c.proc for name, c in self.children.items()}

    # --- start ---------------------------------------------------------------------------------

    def start(self, specs: list[ProcessSpec]) -> None:
        for spec in specs:
            self.tails[spec.name] = collections.deque(maxlen=40)
            color = COLORS[len(self.children) % len(COLORS)]
            self.children[spec.name] = Child(spec, self._spawn(spec, color, "w"), color)
        self._write_status()

    def _spawn(self, spec: ProcessSpec, color: str, log_mode: str) -> subprocess.Popen:
        env = {**os.environ, **spec.env, "PDSDK_STATS_DIR": str(self.log_dir / "stats")}
        cmd, fds = list(spec.cmd), ()
        if spec.listen:
            sock = self._sockets.get(spec.name) or self._listen(spec)
            cmd, fds = [*cmd, "--listen-fd", str(sock.fileno())], (sock.fileno(),)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=fds,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.log_dir,
                                text=True, errors="replace", bufsize=1)
        t = threading.Thread(target=self._pump, args=(spec.name, proc, color, log_mode), daemon=True)
        t.start()
        self._threads.append(t)
        return proc

    def _listen(self, spec: ProcessSpec) -> socket.socket:
        """Bind the spec's port here, once: its restarts serve on the same socket, and connections
        made while none runs wait in its backlog instead of being refused."""
        host = self.plan.host
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, spec.port))
        except OSError as e:
            sock.close()
            raise ConfigError("--port", f"cannot listen on {host}:{spec.port} ({e.strerror or e})") from None
        sock.listen(2048)
        self._sockets[spec.name] = sock
        return sock

    def _pump(self, name: str, proc: subprocess.Popen, color: str, log_mode: str) -> None:
        with open(self.log_dir / f"{name}.log", log_mode) as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                line = line.rstrip()
                self.tails[name].append(line)
                if self.echo and not self.stopping.is_set():
                    self.console.print(f"[{color}]{name:>10}[/] | {escape(line)}", highlight=False, soft_wrap=True)

    # --- health --------------------------------------------------------------------------------

    def wait_healthy(self, specs: list[ProcessSpec], timeout_s: float) -> None:
        """Block until every spec answers its health URL; ChildDied or TimeoutError otherwise."""
        start = time.monotonic()
        healthy: dict[str, float] = {}
        with Live(self._status_table(specs, healthy, start), console=self.console, refresh_per_second=2,
                  transient=False) as live:
            while len(healthy) < len(specs):
                self.check_children()
                for spec in specs:
                    if spec.name not in healthy and _answers(spec.url + spec.health_path):
                        healthy[spec.name] = time.monotonic() - start
                        self.children[spec.name].healthy(time.monotonic())
                        self._write_status()
                live.update(self._status_table(specs, healthy, start))
                if time.monotonic() - start > timeout_s:
                    waiting = [s.name for s in specs if s.name not in healthy]
                    raise TimeoutError(f"not healthy after {timeout_s:.0f}s: {', '.join(waiting)}; "
                                       f"logs in {self.log_dir}")
                time.sleep(0.5)

    def _status_table(self, specs: list[ProcessSpec], healthy: dict[str, float], start: float) -> Table:
        table = Table(title=f"starting ({time.monotonic() - start:.0f}s)", show_edge=False)
        for col in ("process", "role", "port", "status"):
            table.add_column(col)
        for s in specs:
            status = f"[green]healthy after {healthy[s.name]:.0f}s[/]" if s.name in healthy else "[yellow]starting[/]"
            table.add_row(s.name, s.role, str(s.port), status)
        return table

    def check_children(self) -> None:
        """While starting: any child that exited stops everything (ChildDied)."""
        for name, c in self.children.items():
            code = c.proc.poll()
            if code is not None and not self.stopping.is_set():
                time.sleep(0.2)  # let the pump thread read the last lines
                raise ChildDied(name, code, list(self.tails[name])[-15:])

    # --- keeping it up -------------------------------------------------------------------------

    def watch(self) -> None:
        """Until stop() (from a signal handler or another thread): restart what exits or hangs, by
        the restart policy; ChildDied when the policy says stop, or gives up on a process."""
        every = min(PROBE_EVERY_S, self.policy.unhealthy_s / 3)
        timeout = min(PROBE_TIMEOUT_S, self.policy.unhealthy_s / 2)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(self.children))) as probes:
            next_probe = 0.0
            while not self.stopping.is_set():
                now = time.monotonic()
                for c in list(self.children.values()):
                    self._tend(c, now)
                if now >= next_probe and self.policy.mode != "never":  # never: exits alone end the launch
                    next_probe = now + every
                    live = [c for c in self.children.values() if c.state != "down"]
                    for c, ok in zip(live, probes.map(lambda c: _answers(c.spec.url + c.spec.live_path, timeout),
                                                      live)):
                        self._judge(c, ok, now)
                self.stopping.wait(0.5)

    def _tend(self, c: Child, now: float) -> None:
        name, policy = c.spec.name, self.policy
        if c.state == "down":
            if now >= c.due:
                self._restart(c)
            return
        code = c.proc.poll()
        if code is None or self.stopping.is_set():
            if code is None and c.state == "starting" and now - c.started > policy.start_timeout_s:
                self._kill(c, f"not healthy {policy.start_timeout_s:.0f} s after its restart")
            return
        time.sleep(0.2)  # let the pump thread read the last lines
        killed, c.killed_because = c.killed_because, None
        why = c.last_exit = killed or exit_reason(code)
        tail = list(self.tails[name])[-15:]
        if not policy.restarts(code):
            raise ChildDied(name, code, tail, f"not restarted (--restart {policy.mode})")
        if c.in_a_row >= policy.max_restarts:
            raise ChildDied(name, code, tail, f"{killed + '; ' if killed else ''}gave up after {c.in_a_row} "
                                              f"restarts in a row (--max-restarts {policy.max_restarts})")
        delay = policy.delay(c.in_a_row)
        c.state, c.due = "down", now + delay
        self.console.print(f"[bold yellow]restart[/]: {name} ({c.spec.role}, port {c.spec.port}) {why}; starting "
                           f"it again in {delay:g} s (restart {c.restarts + 1}, {c.in_a_row + 1} of at most "
                           f"{policy.max_restarts} in a row)", highlight=False)
        self._write_status()

    def _restart(self, c: Child) -> None:
        with self._lock:
            if self.stopping.is_set():
                return
            _signal_group(c.proc, signal.SIGKILL)  # what the dead process started goes too
            try:
                c.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            c.proc = self._spawn(c.spec, c.color, "a")
            c.state, c.started, c.healthy_since = "starting", time.monotonic(), None
            c.restarts += 1
            c.in_a_row += 1
        self._write_status()

    def _judge(self, c: Child, ok: bool, now: float) -> None:
        if c.proc.poll() is not None or c.state == "down":
            return  # _tend handles exits
        if ok:
            if c.state == "starting":
                took = time.monotonic() - c.started
                self.console.print(f"[bold green]back[/]: {c.spec.name} is healthy again, {took:.0f} s after "
                                   "its restart", highlight=False)
            changed = c.state != "healthy"
            c.healthy(now)
            if changed:
                self._write_status()
        elif c.state == "healthy":
            c.state, c.failing_since = "unhealthy", now
            self._write_status()
        elif c.state == "unhealthy" and now - c.failing_since >= self.policy.unhealthy_s:
            self._kill(c, f"failed its health check for {now - c.failing_since:.0f} s")

    def _kill(self, c: Child, why: str) -> None:
        c.killed_because = f"killed by the launcher: {why}"
        _signal_group(c.proc, signal.SIGKILL)

    def _write_status(self) -> None:
        """<log-dir>/status.json: each process's state, pid and restart count (replaced atomically)."""
        status = {"updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "processes": {name: c.describe() for name, c in self.children.items()}}
        tmp = self.log_dir / "status.json.tmp"
        try:
            tmp.write_text(json.dumps(status, indent=1))
            tmp.replace(self.log_dir / "status.json")
        except OSError:
            pass  # the log folder went away: the status is a convenience, not the supervisor's job

    # --- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM every process group (router first), SIGKILL what is left after the grace period."""
        with self._lock:
            self.stopping.set()
        procs = [c.proc for c in self.children.values()]
        for proc in reversed(procs):
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in procs:
            _signal_group(proc, signal.SIGKILL)  # the group: children a worker started die with it
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for sock in self._sockets.values():
            sock.close()
        for t in self._threads:
            t.join(2)
        if self.plan.ipc_dir:
            shutil.rmtree(self.plan.ipc_dir, ignore_errors=True)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _answers(url: str, timeout: float = 2) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=timeout).status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
