"""`pdsdk launch` as a user runs it, for the engine tier: start it, wait for its router, find its processes."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path

from helpers import pdsdk_cli

from pdsdk.ports import free_port


def processes_using(marker: str) -> list[int]:
    """Live processes whose command line mentions `marker` (the test's own model folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def launch(model: str, transport: str, log_dir: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([pdsdk_cli(), "launch", "--engine", "vllm", "--model", model, "--transport", transport,
                             "--served-model-name", "tiny", "--port", str(port), "--quiet", "--log-dir", str(log_dir),
                             *extra, "--", "--max-model-len", "1024"],
                            stdout=open(log_dir.parent / f"{log_dir.name}-launcher.log", "w"), stderr=subprocess.STDOUT)
    return proc, port


def wait_for(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"launcher exited with {proc.returncode}"
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError("router not healthy")
