"""Requests in flight and breaker states per worker, shared by the router's processes.

A file mapped into every process: one row per serving process, one column per worker slot (the
primary gives each worker a slot). A process writes only its own row and readers sum (or take the
worst of) a column, so no lock is needed and no write is lost.
"""

from __future__ import annotations

import mmap
import os

from pdsdk.router.breaker import STATES

SLOTS = 4096  # workers one router can serve at once
_STATE_CODE = {s: i for i, s in enumerate(STATES)}


class LoadTable:
    def __init__(self, path: str, processes: int, row: int | None, create: bool = False):
        self.processes, self.row = processes, row
        size = processes * SLOTS * 9  # int64 in-flight counts, then int8 breaker states
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"{path} does not hold a table for {processes} processes")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._base = memoryview(self._map)
        counts, self._state_at = self._base[:processes * SLOTS * 8].cast("q"), processes * SLOTS * 8
        self._counts = [counts[i * SLOTS:(i + 1) * SLOTS] for i in range(processes)]
        self._states = [self._base[self._state_at + i * SLOTS:self._state_at + (i + 1) * SLOTS]
                        for i in range(processes)]
        self._views = [counts, *self._counts, *self._states]  # released before the map closes
        self._mine = self._counts[row] if row is not None else None

    def add(self, slot: int, delta: int) -> None:
        """This process's requests in flight to the worker in `slot` changed by `delta`."""
        self._mine[slot] += delta

    def total(self, slot: int) -> int:
        """Requests in flight to the worker in `slot`, from every process."""
        return sum([row[slot] for row in self._counts])

    def set_breaker(self, slot: int, state: str) -> None:
        self._states[self.row][slot] = _STATE_CODE[state]

    def breaker(self, slot: int) -> str:
        """The worst breaker state any process holds for the worker in `slot`."""
        return STATES[max([row[slot] for row in self._states])]

    def clear_row(self, row: int) -> None:
        """A process died: what it had in flight, and its breakers, are gone with it."""
        self._base[row * SLOTS * 8:(row + 1) * SLOTS * 8] = bytes(SLOTS * 8)
        self._states[row][:] = bytes(SLOTS)

    def close(self) -> None:
        for v in self._views:
            v.release()
        self._base.release()
        self._map.close()
