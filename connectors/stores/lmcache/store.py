"""`lmcache`: pages in LMCache's storage manager (its CPU tier, plus its disk and remote tiers).

Where LMCache runs:
- in process, when `lmcache` is importable here (`pip install "pdsdk[lmcache]"` on a machine
  where its wheels install cleanly);
- otherwise in a worker process started from another Python that has it (LMCache 0.5.6 needs
  CUDA-flavoured wheels, transformers>=5.4 and setuptools<81, which a CPU engine venv may not
  take; `make test` builds `.venv/lmcache`). The interpreter is the `python` option, else
  $PDSDK_LMCACHE_PYTHON, else `<this venv>/lmcache/bin/python`. The worker runs
  `worker.py` (no pdsdk import), over a Unix socketpair carrying length-prefixed msgpack
  frames; calls are serialised by a lock (one request in flight; LMCache's own threads do the I/O).

Either way the LMCache code is the same (`worker.LMCacheBackend`). A worker that dies or
stops answering within `timeout_s` is killed; calls answer misses (counting an error) and a new
worker starts in the background, with backoff; its CPU tier starts empty.

Eviction is LMCache's (LRU in its CPU pool of `cpu_bytes`; pages that find no room are not
stored, put returns fewer). Retention hints are not honoured: LMCache has no priority or TTL.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from pdsdk.connectors.stores.base import Buffer, Hints, Store, byte_view, copy_into, log
from pdsdk.connectors.stores.common.backoff import Backoff
from pdsdk.connectors.stores.lmcache import worker as lmcache_worker
from pdsdk.errors import ConfigError, MissingDependency

WORKER = Path(lmcache_worker.__file__)


def side_python(python: str | None = None) -> str | None:
    """The interpreter that has LMCache for the worker, or None."""
    for candidate in (python, os.environ.get("PDSDK_LMCACHE_PYTHON"), str(Path(sys.prefix) / "lmcache/bin/python")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def runtime(mode: str = "auto", python: str | None = None) -> tuple[str, str | None] | None:
    """("inprocess", None), ("worker", interpreter), or None when LMCache is nowhere to be found."""
    if mode not in ("auto", "inprocess", "worker"):
        raise ConfigError("mode", f"{mode!r}; choose auto, inprocess or worker")
    if mode != "worker" and _importable("lmcache"):
        return "inprocess", None
    exe = side_python(python) if mode != "inprocess" else None
    return ("worker", exe) if exe else None


class _Worker:
    """One worker process and its socket; `call` is not thread-safe (the store locks)."""

    def __init__(self, python: str, options: dict, start_timeout_s: float, log_level: str):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "LMCACHE_LOG_LEVEL": log_level, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0"),
               "OMP_NUM_THREADS": "1"}
        env.pop("PYTHONPATH", None)  # the worker's venv only; never this tree's modules
        try:
            # -P: the worker's directory (this package) does not go on its sys.path.
            self.proc = subprocess.Popen([python, "-P", str(WORKER), str(child.fileno())], pass_fds=[child.fileno()],
                                         stdin=subprocess.DEVNULL, stdout=sys.__stderr__ or subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        finally:
            child.close()
        self.sock = parent
        self._enc, self._dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
        try:
            self.info = self.call(options, timeout_s=start_timeout_s)  # the first frame: the options
        except BaseException:
            self.kill()
            raise

    def call(self, request: Any, timeout_s: float) -> Any:
        """Send one request, return the result; raises OSError/TimeoutError if the worker is gone,
        RuntimeError if it answered with an error."""
        self.sock.settimeout(timeout_s)
        lmcache_worker.send_frame(self.sock, self._enc.encode(request))
        frame = lmcache_worker.recv_frame(self.sock)
        if frame is None:
            raise ConnectionError(f"LMCache worker (pid {self.proc.pid}) exited with {self.proc.poll()}")
        ok, result = self._dec.decode(frame)
        if not ok:
            raise RuntimeError(result)
        return result

    def close(self, timeout_s: float = 8.0) -> None:
        try:
            self.call(["close"], timeout_s=timeout_s)
            self.proc.wait(timeout_s)
        except (OSError, RuntimeError, subprocess.TimeoutExpired):
            pass
        self.kill()

    def kill(self) -> None:
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class LMCacheStore(Store):
    def __init__(self, name: str = "lmcache", model: str = "pdsdk", cpu_bytes: int = 1 << 30,
                 disk_path: str | None = None, disk_bytes: int = 0, remote_url: str | None = None,
                 remote_serde: str = "naive", config: dict | None = None, mode: str = "auto",
                 python: str | None = None, start_timeout_s: float = 180.0, timeout_s: float = 30.0,
                 backoff_max_s: float = 5.0, log_level: str = "WARNING"):
        super().__init__(name)
        self._options = {"model": model, "cpu_bytes": int(cpu_bytes), "disk_path": disk_path,
                         "disk_bytes": int(disk_bytes), "remote_url": remote_url, "remote_serde": remote_serde,
                         "config": dict(config or {})}
        found = runtime(mode, python)
        if found is None:
            raise MissingDependency(
                f"store '{name}'", "lmcache",
                ImportError("lmcache is not importable here and no LMCache python was found (the python option, "
                            f"$PDSDK_LMCACHE_PYTHON, {Path(sys.prefix) / 'lmcache/bin/python'}; `make` target "
                            "$(VENV)/.lmcache builds it)"))
        self.mode, self.python = found
        self.timeout_s, self.start_timeout_s, self.log_level = timeout_s, start_timeout_s, log_level
        self._lock = threading.Lock()
        self._backoff = Backoff(max_s=backoff_max_s)
        self._closed = False
        self._starting = False
        self._backend: lmcache_worker.LMCacheBackend | None = None
        self._worker: _Worker | None = None
        if self.mode == "inprocess":
            if log_level:
                os.environ.setdefault("LMCACHE_LOG_LEVEL", log_level)
            self._backend = lmcache_worker.LMCacheBackend(**self._options)
        else:
            # A worker that cannot start is a configuration problem: say so now, not as misses.
            self._worker = _Worker(self.python, self._options, start_timeout_s, log_level)
            log.info("%s: LMCache worker pid %d (%s), tiers %s", name, self._worker.proc.pid, self.python,
                     self._worker.info.get("backends"))

    @property
    def worker_pid(self) -> int | None:
        return self._worker.proc.pid if self._worker else None

    # -- calls -------------------------------------------------------------------------------------
    def _call(self, op: str, args: list, default: Any) -> Any:
        if self._backend is not None:
            try:
                return getattr(self._backend, op)(*args)
            except Exception as e:  # noqa: BLE001 - never into the engine
                log.warning("%s: %s failed: %s", self.name, op, e)
                self.record_error()
                return default
        with self._lock:
            worker = self._worker
            if worker is None:
                self._restart_later()
                return default
            try:
                return worker.call([op, *args], self.timeout_s)
            except RuntimeError as e:  # the worker answered with an error: it is alive
                log.warning("%s: %s failed in the LMCache worker: %s", self.name, op, e)
                self.record_error()
                return default
            except (OSError, ValueError, msgspec.DecodeError) as e:
                log.warning("%s: LMCache worker lost during %s (%s); answering misses, restarting it",
                            self.name, op, e)
                self.record_error()
                self._worker = None
                worker.kill()
                self._backoff.failed()
                self._restart_later()
                return default

    def _restart_later(self) -> None:
        """Start a new worker in the background when the backoff allows (caller holds the lock)."""
        if self._closed or self._starting or not self._backoff.ready():
            return
        self._starting = True

        def start():
            worker = None
            try:
                worker = _Worker(self.python, self._options, self.start_timeout_s, self.log_level)
            except Exception as e:  # noqa: BLE001
                log.warning("%s: LMCache worker did not start: %s", self.name, e)
            with self._lock:
                self._starting = False
                if worker is None:
                    self._backoff.failed()
                elif self._closed:
                    worker.kill()
                else:
                    self._worker = worker
                    self._backoff.succeeded()
                    log.info("%s: LMCache worker restarted (pid %d)", self.name, worker.proc.pid)

        threading.Thread(target=start, name=f"pdsdk-{self.name}-restart", daemon=True).start()

    def wait_ready(self, timeout_s: float) -> bool:
        """True once a worker (or the in-process backend) is there; for tests and start-up."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._backend is not None or self._worker is not None:
                return True
            with self._lock:
                self._restart_later()
            time.sleep(0.1)
        return False

    # -- the Store contract ------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], pages: Sequence[Buffer], hints: Hints | None = None) -> int:
        views = [byte_view(p) for p in pages[: len(keys)]]
        keys = [bytes(k) for k in keys[: len(views)]]
        if not keys:
            return 0
        stored = self._call("put", [keys, views], 0)
        self.record_put(stored, sum(len(v) for v in views[:stored]))
        return stored

    def get(self, keys: Sequence[bytes], out: Sequence[Buffer]) -> int:
        keys = [bytes(k) for k in keys[: len(out)]]
        views = [byte_view(o) for o in out[: len(keys)]]
        nbytes = 0

        def sink(i: int, page) -> bool:
            nonlocal nbytes
            if len(page) > len(views[i]):
                log.warning("%s: page of %d bytes does not fit a %d-byte buffer", self.name, len(page), len(views[i]))
                return False
            copy_into(views[i], page)
            nbytes += len(page)
            return True

        if not keys:
            hits = 0
        elif self._backend is not None:
            hits = self._call("get", [keys, sink], 0)
        else:
            hits = 0
            for i, page in enumerate(self._call("get", [keys], [])):
                if not sink(i, page):
                    break
                hits += 1
        self.record_get(hits, len(keys), nbytes)
        return hits

    def contains(self, keys: Sequence[bytes]) -> int:
        return self._call("contains", [[bytes(k) for k in keys]], 0) if keys else 0

    def delete(self, keys: Sequence[bytes]) -> int:
        return self._call("delete", [[bytes(k) for k in keys]], 0) if keys else 0

    def stats(self) -> dict:
        return {**super().stats(), "mode": self.mode, "worker_pid": self.worker_pid,
                "reachable": self._backend is not None or self._worker is not None,
                **self._call("stats", [], {})}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worker, self._worker = self._worker, None
            backend, self._backend = self._backend, None
        if worker is not None:
            worker.close()
        if backend is not None:
            backend.close()
