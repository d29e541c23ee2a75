"""A transport between processes of one host that reads and writes the peer's memory through
/proc/<pid>/mem, with notifications in loopback UDP datagrams: the least a cross-process transport
must do to pass pdsdk's conformance suite. Host memory only; one system call per span."""

import ctypes
import os
import socket

from pdsdk import TransferStatus, Transport, TransportError


class ProcMemTransport(Transport):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._inbox = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._inbox.bind((self.host, 0))
        self._inbox.setblocking(False)
        self._peer_files: list[int] = []

    def _path(self):
        return "/proc/pid/mem"

    def _register(self, regions):
        if any(r.device != "cpu" for r in regions):
            raise TransportError(f"{self.name}: host memory only")

    def _metadata(self):
        return {"pid": os.getpid(), "inbox": list(self._inbox.getsockname())}

    def _connect(self, descriptor, peer):
        try:
            fd = os.open(f"/proc/{int(descriptor.meta['pid'])}/mem", os.O_RDWR)
        except OSError as e:
            raise TransportError(f"{self.name}: cannot open the memory of peer {descriptor.agent}: {e}") from None
        self._peer_files.append(fd)
        return fd

    def _post(self, op, peer, local, remote, notify):
        for (li, lo, n), (ri, ro, _) in zip(local.tolist(), remote.tolist()):
            mine = (ctypes.c_char * n).from_address(self.regions[li].addr + lo)
            theirs = peer.regions[ri].addr + ro
            moved = os.preadv(peer.backend, [mine], theirs) if op == "READ" else os.pwrite(peer.backend, mine, theirs)
            if moved != n:  # the peer is gone: its memory reads as nothing
                raise ConnectionError(f"moved {moved} of {n} bytes with peer {peer.agent}")
        if notify is not None:
            self._inbox.sendto(self.agent.encode() + b"\0" + notify, tuple(peer.backend_meta["inbox"]))

    def _poll(self, backend):
        return TransferStatus("done")  # _post moved the bytes already

    def _notifications(self):
        notes = []
        while True:
            try:
                agent, _, message = self._inbox.recv(1 << 16).partition(b"\0")
            except BlockingIOError:
                return notes
            notes.append((agent.decode(), message))

    def _close(self):
        self._inbox.close()
        for fd in self._peer_files:
            os.close(fd)
