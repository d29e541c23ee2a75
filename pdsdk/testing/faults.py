"""Faults injected into an engine's transport by a test, through a plugin it registers (`plugin_env`).

`corrupt_reads`: the transport named by option `inner` (its options: `inner_options`), except that
the bytes each read brings in are overwritten with random ones once it is done. An engine given it
must then answer differently, which shows that it serves from the bytes it received. Descriptors are
the inner transport's, so the peer runs the plain one.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from pdsdk import hookimpl, open_transport
from pdsdk.connectors.transports.common.buffers import host_array, torch_view
from pdsdk.kv import Region, page_spans, span_array

log = logging.getLogger(__name__)


@hookimpl
def pdsdk_add_transports(registrar) -> None:
    registrar.add("corrupt_reads", "pdsdk.testing.faults:CorruptReads",
                  summary="a transport whose reads land random bytes (test fault)")


class CorruptReads:
    # name: "corrupt_reads", unused: the inner transport names itself in descriptors
    def __init__(self, *, name: str, inner: str, inner_options: dict | None = None, **kwargs: Any):
        self._inner = open_transport(inner, **kwargs, **(inner_options or {}))
        self._landing: dict[int, np.ndarray] = {}  # read handle -> its local spans

    def read(self, peer: Any, local: Any, remote: Any, notify: bytes | None = None) -> int:
        handle = self._inner.read(peer, local, remote, notify)
        self._landing[handle] = span_array(local)
        return handle

    def read_pages(self, peer: Any, local_region: int, local_pages: Any, remote_region: int, remote_pages: Any,
                   notify: bytes | None = None) -> int:
        handle = self._inner.read_pages(peer, local_region, local_pages, remote_region, remote_pages, notify)
        self._landing[handle] = page_spans(local_region, local_pages, self._inner.layout.page_bytes)
        return handle

    def poll(self, handle: int) -> Any:
        status = self._inner.poll(handle)
        spans = self._landing.pop(handle, None) if status.final else None
        if spans is not None and status.state == "done":
            scribble(self._inner.regions, spans)
            log.warning("corrupt_reads: scribbled over the %d bytes read %d brought in", spans[:, 2].sum(), handle)
        return status

    def wait(self, handle: int, timeout: float | None = None) -> Any:
        status = self._inner.wait(handle, timeout)
        return self.poll(handle) if status.final else status

    def __getattr__(self, name: str) -> Any:  # everything else is the inner transport's
        return getattr(self._inner, name)


def scribble(regions: list[Region], spans: np.ndarray) -> None:
    """Random bytes over `spans` of registered memory, host or GPU."""
    rng = np.random.default_rng()
    for r, offset, length in spans.tolist():
        region = regions[r]
        noise = rng.integers(0, 256, length, dtype=np.uint8)
        if region.device == "cpu":
            host_array(region.addr + offset, length)[:] = noise
        else:
            import torch

            torch_view(region.addr + offset, length, region.device).copy_(torch.from_numpy(noise))
