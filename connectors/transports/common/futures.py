"""Small helpers over concurrent.futures shared by the thread-pool transports."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np


def all_of(futures: list[Future]) -> Future:
    """One future that completes when all do, failing with the first exception."""
    if len(futures) == 1:
        return futures[0]
    combined: Future = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(f: Future) -> None:
        with lock:
            remaining[0] -= 1
            if combined.done():
                return
            if f.exception() is not None:
                combined.set_exception(f.exception())
            elif remaining[0] == 0:
                combined.set_result(None)

    for f in futures:
        f.add_done_callback(done)
    return combined


def byte_parts(lengths: np.ndarray, parts: int) -> list[slice]:
    """Split consecutive spans into at most `parts` slices of about equal bytes."""
    cuts = np.searchsorted(np.cumsum(lengths), np.arange(1, parts) * (int(lengths.sum()) / parts), side="right")
    bounds = [0, *sorted(set(int(c) for c in cuts)), len(lengths)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
