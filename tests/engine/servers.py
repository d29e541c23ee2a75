"""Real vLLM servers for the engine tier: start, wait for health (failing fast), stop cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from pdsdk.adapters.vllm.command import cpu_env, server_command
from pdsdk.ports import free_port

START_TIMEOUT_S = 420  # cold torch.compile on 2 shared cores can take minutes


class VllmServer:
    def __init__(self, name: str, model: str, log_dir: Path, *, cores: str, role: str | None = None,
                 pdsdk_config: dict | None = None, env: dict | None = None, block_size: int = 32,
                 extra_args: tuple[str, ...] = ()):
        self.name, self.port = name, free_port()
        self.log_path = log_dir / f"{name}.log"
        cmd = server_command(model, self.port, role=role, pdsdk_config=pdsdk_config, served_name="tiny",
                             block_size=block_size, max_model_len=1024, extra_args=extra_args)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, cwd=log_dir,
                                     env={**os.environ, **cpu_env(cores), **(env or {})})

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).status == 200:
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} not healthy after {START_TIMEOUT_S}s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def complete(self, body: dict, request_id: str | None = None, timeout: float = 120) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "X-Request-Id": request_id or str(uuid.uuid4())})
        return json.loads(urllib.request.urlopen(req, timeout=timeout).read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


def start_all(*servers: VllmServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        for s in servers:
            s.wait_healthy(deadline)
    except Exception:
        for s in servers:
            s.stop()
        raise


def pd_complete(prefill: VllmServer, decode: VllmServer, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """One request the way NixlConnector's proxy sends it: prefill (max_tokens 1), then decode."""
    rid = str(uuid.uuid4())
    first = prefill.complete({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": False,
                              "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                                     "remote_engine_id": None, "remote_block_ids": None,
                                                     "remote_host": None, "remote_port": None}}, rid)
    params = first["kv_transfer_params"]
    out = decode.complete({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "kv_transfer_params": params}, rid)
    return out["choices"][0]["text"], params
