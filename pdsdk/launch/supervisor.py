"""Start the planned processes, stream their logs with a prefix, wait for health with a live
display, and stop everything cleanly: on Ctrl-C/SIGTERM, or when any child dies (with its last lines).

Every child runs in its own process group, so stopping it stops what it started too (vLLM's
EngineCore and workers): no orphans, ports freed.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
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

from pdsdk.errors import PdsdkError
from pdsdk.launch.plan import LaunchPlan, ProcessSpec

COLORS = ("cyan", "magenta", "green", "yellow", "blue", "red")
STOP_GRACE_S = 20


class ChildDied(PdsdkError):
    def __init__(self, name: str, code: int, tail: list[str]):
        self.name, self.code, self.tail = name, code, tail
        lines = "\n".join(f"  {line}" for line in tail)
        super().__init__(f"{name} exited with code {code}; its last lines:\n{lines}")


class Supervisor:
    def __init__(self, plan: LaunchPlan, log_dir: Path, console: Console | None = None, echo: bool = True):
        self.plan = plan
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.console = console or Console()
        self.echo = echo
        self.procs: dict[str, subprocess.Popen] = {}
        self.tails: dict[str, collections.deque] = {}
        self._threads: list[threading.Thread] = []
        self.stopping = threading.Event()
        if plan.ipc_dir:  # the workers' KV event sockets: this user's only
            os.makedirs(plan.ipc_dir, mode=0o700, exist_ok=True)

    # --- start ---------------------------------------------------------------------------------

    def start(self, specs: list[ProcessSpec]) -> None:
        for i, spec in enumerate(specs):
            env = {**os.environ, **spec.env, "PDSDK_STATS_DIR": str(self.log_dir / "stats")}
            proc = subprocess.Popen(spec.cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.log_dir,
                                    text=True, errors="replace", bufsize=1)
            self.procs[spec.name] = proc
            self.tails[spec.name] = collections.deque(maxlen=40)
            color = COLORS[(len(self.procs) - 1) % len(COLORS)]
            t = threading.Thread(target=self._pump, args=(spec.name, proc, color), daemon=True)
            t.start()
            self._threads.append(t)

    def _pump(self, name: str, proc: subprocess.Popen, color: str) -> None:
        with open(self.log_dir / f"{name}.log", "w") as log:
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
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None and not self.stopping.is_set():
                time.sleep(0.2)  # let the pump thread read the last lines
                raise ChildDied(name, code, list(self.tails[name])[-15:])

    def watch(self) -> None:
        """Until a child dies (ChildDied) or stop() is called from a signal handler."""
        while not self.stopping.is_set():
            self.check_children()
            time.sleep(0.5)

    # --- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM every process group (router first), SIGKILL what is left after the grace period."""
        self.stopping.set()
        for name in reversed(list(self.procs)):
            _signal_group(self.procs[name], signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGKILL)  # the group: children a worker started die with it
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for t in self._threads:
            t.join(2)
        if self.plan.ipc_dir:
            shutil.rmtree(self.plan.ipc_dir, ignore_errors=True)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _answers(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
