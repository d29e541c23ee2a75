"""Real servers for store tests, on free loopback ports, started and stopped by the tests.

Import the fixtures into a test module (`from stores.servers import redis_server`) to use them."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """One server process that can be killed and started again on the same ports."""

    def __init__(self, argv: list[str], port: int, log: Path):
        self.argv, self.port, self.log = argv, port, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        self.proc = subprocess.Popen(self.argv, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        wait_port(self.port)
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


def redis_argv(port: int, workdir: Path, maxmemory: str = "64mb") -> list[str]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (make test installs it: apt redis-server)")
    return [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir), "--maxmemory", maxmemory, "--maxmemory-policy", "volatile-lru"]


def start_redis(workdir: Path, maxmemory: str = "64mb") -> Server:
    port = free_port()
    return Server(redis_argv(port, workdir, maxmemory), port, workdir / "redis.log").start()


def start_mooncake_master(workdir: Path) -> Server:
    exe = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("mooncake_master is not installed (pip install 'pdsdk[mooncake-cpu]')")
    rpc, http, metrics = free_port(), free_port(), free_port()
    argv = [exe, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", f"--metrics_port={metrics}",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}", "--default_kv_lease_ttl=500"]
    return Server(argv, rpc, workdir / "mooncake_master.log").start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    server = start_mooncake_master(tmp_path_factory.mktemp("mooncake"))
    yield server
    server.stop()


def mooncake_options(master: Server) -> dict:
    # A small segment: every test store contributes it to the pool.
    return {"master": f"127.0.0.1:{master.port}", "segment_bytes": 32 << 20, "buffer_bytes": 16 << 20,
            "probe_s": 0.2, "prefix": f"t{os.getpid()}-{time.monotonic_ns()}/"}
