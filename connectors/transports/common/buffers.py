"""Views over raw registered memory, and allocation of test/bench regions.

Transports receive addresses, not tensors: these helpers turn an (address, length, device)
back into a numpy array (host) or a torch tensor (host or CUDA) without copying.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from pdsdk.kv import Region

PAGE = 4096


def cuda_index(device: str) -> int | None:
    """None for host memory, N for "cuda:N" (bare "cuda" is device 0)."""
    if device == "cpu":
        return None
    if not device.startswith("cuda"):
        raise ValueError(f"device {device!r} is not 'cpu' or 'cuda:N'")
    return int(device.partition(":")[2] or 0)


def host_array(addr: int, length: int) -> np.ndarray:
    """A uint8 numpy view of host memory at `addr` (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(addr))


class _CudaArray:
    """Just enough of __cuda_array_interface__ for torch.as_tensor to wrap a device pointer."""

    def __init__(self, addr: int, length: int):
        self.__cuda_array_interface__ = {"shape": (length,), "typestr": "|u1", "data": (addr, False),
                                         "version": 3, "strides": None}


def torch_view(addr: int, length: int, device: str) -> Any:
    """A uint8 torch tensor over registered memory (no copy)."""
    import torch

    index = cuda_index(device)
    if index is None:
        return torch.from_numpy(host_array(addr, length))
    return torch.as_tensor(_CudaArray(addr, length), device=f"cuda:{index}")


def allocate(nbytes: int, device: str = "cpu") -> tuple[Any, Region]:
    """A zeroed buffer and its Region. Keep the buffer alive as long as the region is registered."""
    index = cuda_index(device)
    if index is None:
        raw = np.zeros(nbytes + PAGE, dtype=np.uint8)  # page-align: faster copies, clean page math
        start = (-raw.ctypes.data) % PAGE
        buf = raw[start:start + nbytes]
        return buf, Region(buf.ctypes.data, nbytes, "cpu")
    import torch

    buf = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
    return buf, Region(buf.data_ptr(), nbytes, f"cuda:{index}")
