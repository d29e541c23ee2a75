"""GPU memory of another process on this host: CUDA IPC handles opened through the runtime and driver
libraries that torch already loaded."""

from __future__ import annotations

import ctypes
from typing import Any

from pdsdk.connectors.transports.common.buffers import cuda_index
from pdsdk.errors import TransportError
from pdsdk.kv import Region


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]  # cudaIpcMemHandle_t, passed by value to open


class CudaIpc:
    def __init__(self) -> None:
        import torch

        torch.cuda.init()
        self.torch = torch
        self.cudart = ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
        self.cudart.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_void_p]
        self.cudart.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
        self.cudart.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.cuda.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                      ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        self.opened: dict[bytes, int] = {}

    def export(self, region: Region) -> dict[str, Any]:
        """IPC handle of the allocation holding the region, and the region's offset in it."""
        with self.torch.cuda.device(cuda_index(region.device)):
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            self._check(self.cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), region.addr),
                        "cuMemGetAddressRange")
            handle = _IpcHandle()
            self._check(self.cudart.cudaIpcGetMemHandle(ctypes.byref(handle), base.value), "cudaIpcGetMemHandle")
        return {"handle": ctypes.string_at(ctypes.byref(handle), 64), "offset": region.addr - base.value}

    def open(self, exported: dict[str, Any], device: int) -> int:
        """Address, in this process, of the peer's region."""
        key = exported["handle"]
        if key not in self.opened:
            with self.torch.cuda.device(device):
                ptr = ctypes.c_void_p()
                handle = _IpcHandle()
                ctypes.memmove(ctypes.byref(handle), key, 64)
                self._check(self.cudart.cudaIpcOpenMemHandle(ctypes.byref(ptr), handle, 1),  # lazy peer access
                            "cudaIpcOpenMemHandle")
            self.opened[key] = ptr.value
        return self.opened[key] + exported["offset"]

    def close(self) -> None:
        for ptr in self.opened.values():
            self.cudart.cudaIpcCloseMemHandle(ptr)
        self.opened.clear()

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise TransportError(f"{what} failed with CUDA error {rc}")
