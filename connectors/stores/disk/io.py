"""Write-side helpers of the disk store: buffers for pwritev, complete positional writes, and
work shared between the calling thread and a few pool threads."""

from __future__ import annotations

import errno
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from pdsdk.connectors.stores.base import Buffer, byte_view

CHUNK_MIN = 64 << 10  # pages per pwritev: at least this many bytes, at most CHUNK_RECORDS pages
CHUNK_MAX = 1 << 20  # a chunk checksummed just before its write is still in the L2 cache
CHUNK_RECORDS = 256  # two iovecs a page, under IOV_MAX (1024)


def as_buffer(page: Buffer) -> memoryview:
    """A page as a memoryview for crc32 and pwritev (any contiguous buffer will do, which is
    cheaper than byte_view's cast); byte_view for what does not export one (torch tensors)."""
    try:
        return memoryview(page)
    except TypeError:
        return byte_view(page)


def fitting(sizes: list[int], room: int) -> int:
    """How many of the leading sizes fit in `room` bytes."""
    return next((j for j, total in enumerate(itertools.accumulate(sizes)) if total > room), len(sizes))


def pwrite_all(fd: int, parts: list, offset: int) -> None:
    """pwritev may write less than asked (and takes at most IOV_MAX buffers): go on until done."""
    parts, i = list(parts), 0  # the caller's list stays whole, for a retry
    while i < len(parts):
        done = os.pwritev(fd, parts[i:i + 1024], offset)
        if done <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += done
        while i < len(parts) and done >= memoryview(parts[i]).nbytes:
            done -= memoryview(parts[i]).nbytes
            i += 1
        if done:
            parts[i] = memoryview(parts[i]).cast("B")[done:]


def write_chunks(sizes: list[int], segment_bytes: int) -> list[tuple[int, int]]:
    """Split a batch into runs of pages written by one pwritev each: a quarter of the batch,
    at least CHUNK_MIN, so that helpers checksum the next runs while one is written."""
    target = min(segment_bytes, CHUNK_MAX, max(CHUNK_MIN, sum(sizes) // 4))
    out, start, acc = [], 0, 0
    for j, s in enumerate(sizes):
        acc += s
        if acc >= target or j + 1 - start >= CHUNK_RECORDS:
            out.append((start, j + 1))
            start, acc = j + 1, 0
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


class Shared:
    """The items of one call, computed by the calling thread and by pool threads helping it:
    whoever is free takes the next item. A call costs one hand-off per helper and never waits
    for a helper the OS has not scheduled yet (on busy cores that wait is long): the caller
    goes on with the items no one has taken. Checksums (zlib, numpy) and file I/O release the
    GIL, so helpers run beside the caller. Without helpers, an item is computed when asked for."""

    _PENDING = object()

    def __init__(self, fn, n: int, pool: ThreadPoolExecutor | None, helpers: int):
        self.fn, self.n = fn, n
        self.results: list = [self._PENDING] * n
        self._next = itertools.count()  # its __next__ is atomic under the GIL
        helpers = helpers if pool is not None and n > 1 else 0
        self._done = [threading.Lock() for _ in range(n)] if helpers else None  # held until item i is done
        for lock in self._done or ():
            lock.acquire()
        for _ in range(helpers):
            pool.submit(self._help)

    def _help(self) -> None:
        while (i := next(self._next)) < self.n:
            self._run(i)

    def _run(self, i: int) -> None:
        try:
            self.results[i] = self.fn(i)
        except BaseException as e:  # noqa: BLE001 - raised in the caller by result()
            self.results[i] = e
        finally:
            if self._done:
                self._done[i].release()

    def stop(self) -> None:
        """Leave the items no one has taken (the caller does not need them)."""
        self.n = 0

    def result(self, i: int):
        """Item i, computing the next free items meanwhile if a helper holds it."""
        if self._done is None:
            return self.fn(i)
        while self.results[i] is self._PENDING:
            j = next(self._next)
            if j < self.n:
                self._run(j)
            else:
                self._done[i].acquire()
        if isinstance(self.results[i], BaseException):
            raise self.results[i]
        return self.results[i]
