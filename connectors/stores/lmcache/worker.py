"""LMCache's StorageManager driven without an engine, for the `lmcache` store.

This file imports nothing from pdsdk (only the standard library, msgspec, torch and lmcache), so
it runs in two ways:
- imported, when `lmcache` is importable in the engine's interpreter: `LMCacheBackend` is used
  directly by `pdsdk.connectors.stores.lmcache.LMCacheStore`;
- as a script, `python -P worker.py FD`, from a separate venv that has LMCache (LMCache
  0.5.6 needs CUDA-flavoured wheels, transformers>=5.4 and setuptools<81). FD is the child end of
  a Unix socketpair; frames are a 4-byte big-endian length and a msgpack body (msgspec; no pickle).
  Request: [op, arg...]. Reply: [true, result] or [false, "error text"]. The first frame the worker
  sends is its start-up reply. EOF on the socket (the parent died or closed) ends the worker.

The engine-less path (as `lmcache.v1.standalone` runs it): LMCacheEngineConfig -> LMCacheMetadata ->
MOCK GPU connector -> StandaloneLMCacheManager -> its engine's StorageManager. A page is one
"token" of n bytes: a uint8 MemoryObj of shape (1, 1, 1, n) in LMCache's KV_2LTD format. A key is
CacheEngineKey(model, 1, 0, int(0x01 || key bytes), uint8): the whole key, no truncation, so
distinct keys never collide in LMCache (its disk files are named by the hash in hex).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

_LEN = struct.Struct(">I")


class LMCacheBackend:
    """Byte pages in LMCache's storage manager (its CPU tier, plus disk/remote tiers if configured)."""

    def __init__(self, model: str = "pdsdk", cpu_bytes: int = 1 << 30, disk_path: str | None = None,
                 disk_bytes: int = 0, remote_url: str | None = None, remote_serde: str = "naive",
                 config: dict | None = None):
        import torch
        from lmcache.utils import CacheEngineKey, EngineType, mock_up_broadcast_fn, mock_up_broadcast_object_fn
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.gpu_connector import CreateGPUConnector
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.standalone.manager import StandaloneLMCacheManager

        self._torch, self._key_cls, self._fmt = torch, CacheEngineKey, MemoryFormat.KV_2LTD
        self.model = model
        gib = float(1 << 30)
        settings: dict[str, Any] = {
            "chunk_size": 256,
            "local_cpu": True,
            "max_local_cpu_size": cpu_bytes / gib,
            "local_disk": f"file://{os.path.abspath(disk_path)}/" if disk_path else None,
            "max_local_disk_size": disk_bytes / gib if disk_path else 0.0,
            "remote_url": remote_url,
            "remote_serde": remote_serde,
        }
        settings.update(config or {})
        if disk_path:
            os.makedirs(disk_path, exist_ok=True)
        cfg = LMCacheEngineConfig.from_dict(settings)
        meta = LMCacheMetadata(model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=torch.uint8, kv_shape=(1, 2, settings["chunk_size"], 1, 1),
                               use_mla=False, role="worker")
        connector = CreateGPUConnector(cfg, meta, EngineType.MOCK)
        self._manager = StandaloneLMCacheManager(cfg, meta, connector, broadcast_fn=mock_up_broadcast_fn,
                                                 broadcast_object_fn=mock_up_broadcast_object_fn)
        self._manager.post_init()
        self._sm = self._manager.lmcache_engine.storage_manager
        self.backends = list(self._sm.storage_backends)

    def _keys(self, keys: Sequence[bytes]) -> list:
        return [self._key_cls(self.model, 1, 0, int.from_bytes(b"\x01" + bytes(k), "big"), self._torch.uint8)
                for k in keys]

    def put(self, keys: Sequence[bytes], pages: Sequence[Any]) -> int:
        """Store pages (buffers); returns how many, in order, found room (LMCache evicts LRU for room)."""
        import numpy as np

        objs = []
        for page in pages[: len(keys)]:
            src = np.frombuffer(page, np.uint8)
            obj = self._sm.allocate(self._torch.Size([1, 1, 1, src.size]), self._torch.uint8, fmt=self._fmt,
                                    eviction=True, busy_loop=False)
            if obj is None:
                break
            np.copyto(obj.tensor.view(-1).numpy(), src)
            objs.append(obj)
        if objs:
            self._sm.batched_put(self._keys(keys[: len(objs)]), objs)  # takes over the references
        return len(objs)

    def get(self, keys: Sequence[bytes], sink: Callable[[int, memoryview], bool]) -> int:
        """Hand the stored prefix of `keys`, page by page, to sink(i, bytes view); a False from
        sink (the page does not fit) ends the prefix. Returns its length."""
        hits = 0
        for i, key in enumerate(self._keys(keys)):
            obj = self._sm.get(key)
            if obj is None:
                break
            try:
                ok = sink(i, memoryview(obj.tensor.view(-1).numpy()))
            finally:
                obj.ref_count_down()
            if not ok:
                break
            hits += 1
        return hits

    def contains(self, keys: Sequence[bytes]) -> int:
        return self._sm.batched_contains(self._keys(keys))[0] if keys else 0

    def delete(self, keys: Sequence[bytes]) -> int:
        present = [k for k in self._keys(keys) if self._sm.contains(k) is not None]
        if present:
            self._sm.batched_remove(present)
        return len(present)

    def stats(self) -> dict:
        return {"backends": self.backends}

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the storage manager; its thread joins take up to 10 s, so wait at most timeout_s."""
        t = threading.Thread(target=self._sm.close, daemon=True, name="lmcache-close")
        t.start()
        t.join(timeout_s)


# -- worker process --------------------------------------------------------------------------------
def recv_frame(sock: socket.socket) -> bytearray | None:
    """One frame's body, or None at EOF."""
    head = _recv_exact(sock, _LEN.size)
    return None if head is None else _recv_exact(sock, _LEN.unpack(head)[0])


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            return None
        got += k
    return buf


def send_frame(sock: socket.socket, body: bytes) -> None:
    if len(body) < 1 << 16:
        sock.sendall(_LEN.pack(len(body)) + body)
    else:  # no concatenated copy of a large frame
        sock.sendall(_LEN.pack(len(body)))
        sock.sendall(body)


def serve(sock: socket.socket) -> None:
    import msgspec

    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    try:
        start = dec.decode(recv_frame(sock) or b"\xc0")
        backend = LMCacheBackend(**(start or {}))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        send_frame(sock, enc.encode([False, f"{type(e).__name__}: {e}"]))
        return
    send_frame(sock, enc.encode([True, {"backends": backend.backends, "pid": os.getpid()}]))

    def get(keys):
        pages: list[bytes] = []
        backend.get(keys, lambda i, view: pages.append(bytes(view)) or True)
        return pages

    ops = {"put": backend.put, "get": get, "contains": backend.contains, "delete": backend.delete,
           "stats": backend.stats}
    while True:
        frame = recv_frame(sock)
        if frame is None:
            break
        op, *args = dec.decode(frame)
        if op == "close":
            backend.close()
            send_frame(sock, enc.encode([True, None]))
            break
        try:
            reply = [True, ops[op](*args)]
        except Exception as e:  # noqa: BLE001 - a failed call is a reply, the worker lives on
            logging.getLogger("pdsdk.lmcache_worker").exception("%s failed", op)
            reply = [False, f"{type(e).__name__}: {e}"]
        send_frame(sock, enc.encode(reply))


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        import torch

        torch.set_num_threads(1)
        serve(sock)
    finally:
        # LMCache leaves non-daemon threads behind: leave at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
