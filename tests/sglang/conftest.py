"""The SGLang tier: runs in the SGLang venv (`make test-sglang`); skipped where SGLang is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:  # the main venv has no SGLang (`import sglang` alone would find this folder as a namespace package)
    import sglang.srt.plugins  # noqa: F401
except ImportError:
    collect_ignore_glob = ["test_*.py"]
    sys.modules.pop("sglang", None)  # drop the namespace-package stand-in for later imports

WORKER = Path(__file__).with_name("pd_worker.py")


class Side:
    """One pd_worker.py process: JSON events on stdout, stderr to a log file."""

    def __init__(self, role: str, port: int, room: int, env: dict, log: Path, *extra: str):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-P", str(WORKER), "--role", role, "--bootstrap-port", str(port),
                                      "--room", str(room), *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log, "w"), text=True, env={**os.environ, **env})

    def until(self, event: str, timeout: float = 120) -> dict:
        """Read events until `event` (or "done"); fails with the log tail when the process dies."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            line = self.proc.stdout.readline()
            if not line:
                break
            msg = json.loads(line)
            if msg["event"] in (event, "done"):
                return msg
        tail = "\n".join(self.log.read_text().splitlines()[-30:])
        raise AssertionError(f"no {event!r} event from {self.proc.args[3:6]}; its log ends:\n{tail}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(20)


@pytest.fixture
def pd(tmp_path):
    """Start prefill/decode sides with `pd(role, port, room, transport, *extra)`; all closed after."""
    sides: list[Side] = []

    def start(role: str, port: int, room: int, transport: str, *extra: str, env: dict | None = None) -> Side:
        side = Side(role, port, room, {"PDSDK_CONFIG": json.dumps({"transport": transport,
                                                                  "timeouts": {"transfer_s": 20}}),
                                       "UCX_MODULES": "^ib", "SGLANG_HOST_IP": "127.0.0.1", **(env or {})},
                    tmp_path / f"{role}-{len(sides)}.log", *extra)
        sides.append(side)
        return side

    yield start
    for side in sides:
        side.close()
