"""`mooncake`: Mooncake Store (`mooncake.store`), a distributed pool that several engines share.

Each client contributes `segment_bytes` of its RAM to the pool and the master (`mooncake_master`,
shipped in the wheel) places objects anywhere in it. Pages go straight from the caller's buffers
(batch_put_from_multi_buffers / batch_get_into_multi_buffers, no intermediate copy in Python),
each object a common/remote_record.py header then the page. A get whose object is not exactly header plus
buffer, or whose header or checksum is bad, is a miss: the object is deleted and an error counted.
`contains` asks only whether the object exists; get finds bad ones (and then contains agrees).

Outages: with the master down every call takes the client's RPC timeout (about 4 s), far too long
for an engine. So the first failure marks the store down, calls answer misses at once, and a
background thread probes the master (and redoes setup if it never succeeded) until it is back.

Leases: the master refuses to remove an object for `default_kv_lease_ttl` after a read
(OBJECT_HAS_LEASE); delete retries those with force. Eviction is the master's (approximate LRU
above its high watermark). Hints: a pin without ttl_s is a hard pin, a pin with one is a soft pin
for that long; other ttl_s, priority and keep are not enforced by Mooncake.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

import numpy as np
from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction

from pdsdk.connectors.stores.base import Buffer, Hints, Store, byte_view, log
from pdsdk.connectors.stores.common.remote_record import HEADER_SIZE, flaw, seal

OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
RPC_FAIL = -900
BUFFER_TOO_SMALL, TRANSFER_FAIL = -600, -800  # also what a get of an object of another size answers


class MooncakeStore(Store):
    def __init__(self, name: str = "mooncake", master: str = "127.0.0.1:50051",
                 metadata_server: str = "P2PHANDSHAKE", local_hostname: str = "127.0.0.1",
                 protocol: str = "tcp", device: str = "", segment_bytes: int = 256 << 20,
                 buffer_bytes: int = 64 << 20, prefix: str = "pdsdk/", probe_s: float = 1.0,
                 connect_timeout_s: float = 10.0):
        super().__init__(name)
        self.master, self.prefix, self.probe_s = master, prefix, probe_s
        self._config = {"local_hostname": local_hostname, "metadata_server": metadata_server,
                        "global_segment_size": int(segment_bytes), "local_buffer_size": int(buffer_bytes),
                        "protocol": protocol, "rdma_devices": device, "master_server_addr": master}
        self._client = MooncakeDistributedStore()
        self._set_up = False
        self._warned = False
        self._up = threading.Event()
        self._closed = threading.Event()
        # The binding holds the GIL: setup() against an absent master freezes the whole process
        # for about 90 s, health_check() for about 4 s. So the prober thread first checks that
        # the master's port accepts connections, and the engine starts with a store that answers
        # misses until the master is there.
        self._prober = threading.Thread(target=self._probe, name=f"pdsdk-{name}-probe", daemon=True)
        self._prober.start()
        self._up.wait(connect_timeout_s)

    def _listening(self) -> bool:
        host, _, port = self.master.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
            return True
        except OSError:
            return False

    def _setup(self) -> None:
        if not self._listening():
            if not self._warned:
                log.warning("%s: mooncake master %s is not listening; answering misses until it is",
                            self.name, self.master)
                self._warned = True
            return
        try:
            rc = self._client.setup(self._config)
        except Exception as e:  # noqa: BLE001 - the binding raises plain RuntimeErrors
            rc = str(e)
        if rc == 0 and self._closed.is_set():  # closed while connecting
            self._client.close()
        elif rc == 0:
            self._set_up = True
            self._up.set()
        else:
            log.warning("%s: cannot reach mooncake master %s (%s); answering misses until it is up",
                        self.name, self.master, rc)

    def _probe(self) -> None:
        self._setup()
        while not self._closed.wait(self.probe_s):
            if self._up.is_set():
                continue
            if not self._set_up:
                self._setup()
            elif self._listening() and self._client.health_check() == 0:
                log.info("%s: mooncake master %s reachable again", self.name, self.master)
                self._up.set()

    def _check(self, codes: Sequence[int]) -> None:
        """An RPC failure means the master is gone: stop calling it until the prober says so."""
        if RPC_FAIL in codes and self._up.is_set():
            log.warning("%s: mooncake master %s unreachable; answering misses", self.name, self.master)
            self._up.clear()
        if any(c < 0 and c not in (OBJECT_NOT_FOUND,) for c in codes):
            self.record_error()

    def _key(self, key: bytes) -> str:
        return self.prefix + bytes(key).hex()

    @staticmethod
    def _pointers(views: Sequence[memoryview]) -> list[int]:
        return [np.frombuffer(v, np.uint8).ctypes.data for v in views]

    @staticmethod
    def _replicate(hints: Hints | None) -> ReplicateConfig:
        config = ReplicateConfig()
        if hints is not None and hints.pin:
            if hints.ttl_s is None:
                config.with_hard_pin = True
            else:
                config.soft_pin_action = SoftPinAction.ENABLE
                config.soft_pin_ttl_ms = int(hints.ttl_s * 1000)
        return config

    def put(self, keys: Sequence[bytes], pages: Sequence[Buffer], hints: Hints | None = None) -> int:
        if not keys or not self._up.is_set():
            return 0
        views = [byte_view(p) for p in pages[: len(keys)]]
        heads = np.frombuffer(b"".join(seal(bytes(k), v) for k, v in zip(keys, views)), np.uint8)
        codes = self._client.batch_put_from_multi_buffers(
            [self._key(k) for k in keys[: len(views)]], self._pointer_pairs(heads, views),
            [[HEADER_SIZE, len(v)] for v in views], self._replicate(hints))
        self._check(codes)
        stored = next((i for i, c in enumerate(codes) if c != 0), len(codes))
        self.record_put(stored, sum(len(v) for v in views[:stored]))
        return stored

    def get(self, keys: Sequence[bytes], out: Sequence[Buffer]) -> int:
        hits = nbytes = 0
        if keys and self._up.is_set():
            views = [byte_view(b) for b in out[: len(keys)]]
            heads = np.zeros(HEADER_SIZE * len(views), np.uint8)
            names = [self._key(k) for k in keys[: len(views)]]
            got = self._client.batch_get_into_multi_buffers(names, self._pointer_pairs(heads, views),
                                                            [[HEADER_SIZE, len(v)] for v in views])
            self._check(got)
            for i, n in enumerate(got):
                head = heads[i * HEADER_SIZE:(i + 1) * HEADER_SIZE]
                why = flaw(bytes(keys[i]), head, views[i], len(views[i])) if n == HEADER_SIZE + len(views[i]) else \
                    self._size_flaw(names[i], n, HEADER_SIZE + len(views[i]))
                if why is not None:
                    log.warning("%s: page %s %s; treated as a miss and deleted", self.name, names[i], why)
                    self.record_error()
                    self.delete([keys[i]])
                if n <= 0 or why is not None:
                    break
                hits, nbytes = hits + 1, nbytes + len(views[i])
        self.record_get(hits, len(keys), nbytes)
        return hits

    def _size_flaw(self, name: str, got: int, want: int) -> str | None:
        """Why a get that did not fill header and buffer failed, when the object is to blame: a size
        other than header plus buffer. None for a miss or a failed transfer."""
        if got not in (BUFFER_TOO_SMALL, TRANSFER_FAIL) and got <= 0:
            return None
        size = self._client.get_size(name)
        return f"holds {size} bytes where header and page take {want}" if 0 <= size != want else None

    @staticmethod
    def _pointer_pairs(heads: np.ndarray, views: Sequence[memoryview]) -> list[list[int]]:
        """[header slot, page] pointers per page, header slots packed in `heads`."""
        base = heads.ctypes.data
        return [[base + i * HEADER_SIZE, p] for i, p in enumerate(MooncakeStore._pointers(views))]

    def contains(self, keys: Sequence[bytes]) -> int:
        if not keys or not self._up.is_set():
            return 0
        found = self._client.batch_is_exist([self._key(k) for k in keys])
        self._check([RPC_FAIL] if -1 in found else [])
        return next((i for i, f in enumerate(found) if f != 1), len(found))

    def delete(self, keys: Sequence[bytes]) -> int:
        if not keys or not self._up.is_set():
            return 0
        names = [self._key(k) for k in keys]
        codes = list(self._client.batch_remove(names, False))
        leased = [i for i, c in enumerate(codes) if c == OBJECT_HAS_LEASE]
        if leased:  # read moments ago: the lease only protects readers, and ours are done
            for i, c in zip(leased, self._client.batch_remove([names[i] for i in leased], True)):
                codes[i] = c
        self._check(codes)
        return sum(c == 0 for c in codes)

    def stats(self) -> dict:
        return {**super().stats(), "reachable": self._up.is_set()}

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._set_up:
            # With the master gone, close() waits out several RPC timeouts: never longer than 2 s here.
            closer = threading.Thread(target=self._client.close, daemon=True)
            closer.start()
            closer.join(2.0)
