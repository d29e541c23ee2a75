"""Load clients of `pdsdk bench router --peer`: `wrk` (C, a Lua script for the POST body; it reads
the SSE answers as chunked HTTP/1.1) when installed, else the lean Python client of pdsdk/testing/lean_worker.py.
Both hold N keep-alive connections in a closed loop for a fixed time and report the same fields."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass

_MARK = "PDSDK_WRK "
# wrk calls done() once with every thread's numbers merged; latency is in microseconds.
_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[%s]==]
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('%s{"requests": %%d, "duration_us": %%d, "p50_us": %%d, "p99_us": %%d, '
    .. '"status_errors": %%d, "other_errors": %%d}\\n', summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), e.status, e.connect + e.read + e.write + e.timeout))
end
"""


@dataclass
class Load:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    client_cpu_s: float


def wrk_path() -> str | None:
    return shutil.which("wrk")


def default_client() -> str:
    return "wrk" if wrk_path() else "python"


def _pct_ms(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 3) if xs else 0.0


def run_python(port: int, connections: int, seconds: int, body: dict) -> Load:
    """The lean asyncio client (lean_worker.run_load) in this process; its CPU time is this process's."""
    from pdsdk.testing.lean_worker import event_loop_runner, run_load

    gc.collect()
    gc.disable()  # the client's own collector passes are not the router's latency
    c0 = time.process_time()
    try:
        res = event_loop_runner()(run_load("127.0.0.1", port, connections, None, body, duration_s=seconds,
                                           count_errors=True))
    finally:
        gc.enable()
    lat = res.latency
    cpu = time.process_time() - c0
    return Load(len(lat), res.seconds, _pct_ms(lat, .5), _pct_ms(lat, .99), res.errors, cpu)


def run_wrk(port: int, connections: int, seconds: int, body: dict, threads: int) -> Load:
    """One wrk run; its CPU time comes from wait4's resource usage."""
    wrk = wrk_path()
    if wrk is None:
        raise FileNotFoundError("wrk is not installed (apt-get install wrk); use --client python")
    threads = max(1, min(threads, connections))
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_LUA % (json.dumps(body), _MARK))
    try:
        proc = subprocess.Popen([wrk, "-t", str(threads), "-c", str(connections), "-d", f"{seconds}s",
                                 "--timeout", "60s", "-s", f.name, f"http://127.0.0.1:{port}/v1/completions"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out = proc.stdout.read().decode(errors="replace")
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        os.unlink(f.name)
    line = next((ln for ln in out.splitlines() if ln.startswith(_MARK)), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed (exit {proc.returncode}): {out[-1000:]}")
    r = json.loads(line[len(_MARK):])
    ok = r["requests"] - r["status_errors"]  # wrk counts an answer that is not 2xx/3xx as a request too
    return Load(ok, r["duration_us"] / 1e6, r["p50_us"] / 1e3, r["p99_us"] / 1e3,
                r["status_errors"] + r["other_errors"], usage.ru_utime + usage.ru_stime)
