"""Local redis-server and mooncake_master processes on free loopback ports, for tests and
`pdsdk bench store --servers`: started, killed and restarted on the same ports."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from pdsdk.ports import free_port


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


class Server:
    def __init__(self, argv: list[str], port: int, log: Path):
        self.argv, self.port, self.log = argv, port, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_port(self.port)
        except TimeoutError:
            self.kill()
            raise
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def redis_exe() -> str | None:
    return shutil.which("redis-server")


def mooncake_master_exe() -> str | None:
    return shutil.which("mooncake_master", path=str(Path(sys.executable).parent)) or shutil.which("mooncake_master")


def start_redis(workdir: Path, maxmemory: str = "64mb") -> Server:
    """No persistence; `volatile-lru`, so pinned pages (stored without expiry) are never evicted."""
    exe = redis_exe()
    if exe is None:
        raise FileNotFoundError("redis-server is not installed (apt install redis-server)")
    port = free_port()
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir), "--maxmemory", maxmemory, "--maxmemory-policy", "volatile-lru"]
    return Server(argv, port, Path(workdir) / "redis.log").start()


def start_mooncake_master(workdir: Path) -> Server:
    exe = mooncake_master_exe()
    if exe is None:
        raise FileNotFoundError("mooncake_master is not installed (pip install 'pdsdk[mooncake-cpu]')")
    rpc, http, metrics = free_port(), free_port(), free_port()
    argv = [exe, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", f"--metrics_port={metrics}",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}", "--default_kv_lease_ttl=500"]
    return Server(argv, rpc, Path(workdir) / "mooncake_master.log").start()
