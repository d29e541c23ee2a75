"""The decode worker's prefill ranks, looked up without blocking vLLM's step.

A new prefill rank is asked for its transport descriptor through its side channel. That can take
up to `connect_s` (a SIGSTOPped or overloaded prefill), and the worker's step runs every request of
the engine: so the ask runs on a small thread pool, and the step sees "not yet" until it is answered.
A rank that did not answer is not asked again for `connect_s`: its requests fail at once, and vLLM
recomputes them. `transport.connect` itself runs on the step's thread, since transports are not
shared between threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pdsdk.adapters.side_channel import fetch

# (engine id, prefill TP rank) -> (connected peer, its block geometry, its head geometry or None)
Key = tuple[str, int]
Entry = tuple[Any, list[list[int]], "list[list[int]] | None"]


class Peers:
    def __init__(self, connect_s: float, fetcher: Callable[[str, int, int, float], dict] = fetch):
        self.connect_s = connect_s
        self._fetch = fetcher
        self._ready: dict[Key, Entry] = {}
        self._asking: dict[Key, Future] = {}
        self._unreachable: dict[Key, tuple[float, str]] = {}  # key -> (ask again after, why)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdsdk-side-channel")

    def get(self, key: Key, host: str, port: int, connect: Callable[[bytes], Any]) -> Entry | None:
        """The connected rank; None while its side channel has not answered yet (ask again next step);
        ConnectionError if it did not answer, or did within the last `connect_s`."""
        entry = self._ready.get(key)
        if entry is not None:
            return entry
        until, reason = self._unreachable.get(key, (0.0, ""))
        if time.monotonic() < until:
            raise ConnectionError(f"prefill {key[0]} rank {key[1]} did not answer {reason}; "
                                  f"not asked again for another {until - time.monotonic():.1f}s")
        asking = self._asking.get(key)
        if asking is None:
            self._asking[key] = self._pool.submit(self._fetch, host, port, key[1], self.connect_s)
            return None
        if not asking.done():
            return None
        del self._asking[key]
        try:
            answer = asking.result()
            self._ready[key] = (connect(answer["descriptor"]), answer["geometry"], answer.get("heads"))
        except Exception as e:
            self._unreachable[key] = (time.monotonic() + self.connect_s, f"({type(e).__name__}: {e})")
            raise
        self._unreachable.pop(key, None)
        return self._ready[key]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
