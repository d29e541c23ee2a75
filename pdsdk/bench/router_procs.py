"""Processes of `pdsdk bench router`: start a server and wait for its port, stop it, and read the
CPU time of a process or of its whole tree (Linux /proc)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no http_proxy


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # fields from the state on (the name may hold spaces)


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process, None where /proc cannot tell."""
    try:
        fields = _stat(pid)
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds of a process and every descendant, live or reaped (a reaped child's time is in
    its parent's cutime/cstime), None where /proc cannot tell."""
    stats: dict[int, list[str]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if name.isdigit():
            try:
                stats[int(name)] = _stat(int(name))
            except (OSError, IndexError):
                pass  # exited while listing
    if pid not in stats:
        return None
    children: dict[int, list[int]] = {}
    for p, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(p)
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        fields = stats[p]
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        todo += children.get(p, [])
    return total / _TICK


def spawn(argv: list[str], port: int, timeout_s: float = 20.0, log: str | None = None) -> subprocess.Popen:
    """Starts argv and returns once something listens on `port` (its output goes to `log`, or nowhere)."""
    with open(log, "ab") if log else contextlib.nullcontext(subprocess.DEVNULL) as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd="/", start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}"
                                   + (f" (its output: {log})" if log else ""))
            time.sleep(0.05)
    stop(proc)
    raise TimeoutError(f"{' '.join(argv)} did not listen on {port} within {timeout_s:g} s")


def wait_answering(port: int, body: bytes, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Waits until POST /v1/completions through `port` answers 200: a router that listens may not
    have its workers yet (health checks, registration in the background)."""
    deadline, last = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode} before answering")
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        try:
            with _DIRECT.open(req, timeout=5) as r:
                r.read()
                return
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(0.2)
    raise TimeoutError(f"the router on port {port} answered no request within {timeout_s:g} s: {last}")


def stop(*procs: subprocess.Popen) -> None:
    """SIGTERM to each process's group (a router may have children), SIGKILL after 10 s."""
    for p in procs:
        if p.poll() is not None:
            continue
        try:
            os.killpg(p.pid, 15)
        except (ProcessLookupError, PermissionError):
            p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
            p.wait(5)
