"""Host memory between two processes of one host with one copy: the kernel's cross-memory attach
(`process_vm_readv`/`process_vm_writev`), from the initiator's threads; the peer spends no CPU."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import numpy as np

IOV_MAX = 1024
MAX_CALL_BYTES = 1 << 30  # the kernel moves at most ~2 GiB per call
_libc = ctypes.CDLL(None, use_errno=True)
for _fn in (_libc.process_vm_readv, _libc.process_vm_writev):
    _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    _fn.restype = ctypes.c_ssize_t


def host_identity() -> str:
    """Same value in two processes iff they can reach each other's memory: boot id + pid namespace."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"


def cma_copy(op: str, pid: int, laddr: np.ndarray, raddr: np.ndarray, lengths: np.ndarray) -> None:
    """Move (local address, remote address, length) triples, IOV_MAX per system call."""
    call = _libc.process_vm_readv if op == "READ" else _libc.process_vm_writev
    for start in range(0, len(lengths), IOV_MAX):
        n = slice(start, start + IOV_MAX)
        liov = np.ascontiguousarray(np.column_stack((laddr[n], lengths[n])), dtype=np.uint64)
        riov = np.ascontiguousarray(np.column_stack((raddr[n], lengths[n])), dtype=np.uint64)
        want = int(lengths[n].sum())
        done = call(pid, liov.ctypes.data, len(liov), riov.ctypes.data, len(riov), 0)
        if done < 0:
            err = ctypes.get_errno()
            if err == errno.ESRCH:
                raise ConnectionError(f"peer process {pid} is gone")
            raise OSError(err, f"{call.__name__} with pid {pid}: {os.strerror(err)}")
        if done != want:  # partial: only when part of the peer's range is unmapped
            raise OSError(errno.EFAULT, f"{call.__name__} moved {done} of {want} bytes; peer memory unmapped?")
