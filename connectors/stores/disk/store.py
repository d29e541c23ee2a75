"""`disk`: pages appended to segment files under a directory, bounded in bytes, evicted by
hint-aware LRU.

Layout: `<path>/<id>.seg` (id: 8 hex digits, increasing), each a run of records
    header (magic, state, version, hints, absolute expiry, payload length, payload checksum,
            key length, CRC-32 of the header and key) | key | payload
The payload checksum is CRC-32, or for pages from 64 KiB a CRC-32 of block sums (checksum).
A put appends its batch to the open segment, a pwritev per chunk of pages, while helper threads
checksum the next chunks (Shared): a page costs a checksum and a copy into the page cache, not a
file create and rename. A new segment starts once the open one reaches `segment_bytes`.
The index (key -> segment, offset) is in memory, rebuilt on open by reading the headers,
oldest segment first, so a reopened store finds its pages in roughly their LRU order.

Crash safety, without fsync: a record is written before the index points at it, and segments
are append-only. A crash mid-append leaves a torn tail, which the scan on open cuts off; a record
whose header fails its checksum elsewhere is stepped over to the next intact header (that record
only is lost). Every read checks the payload's checksum (and the header and key): a damaged or
truncated record is a miss plus a log line and is dropped, never wrong bytes.

Delete and eviction set the record's state byte to dead in place (it is outside the header
checksum, and no flip of a few bits makes a dead byte live), so a reopened store does not bring
them back; a segment left with no live record is unlinked. `capacity_bytes` bounds the segment files, dead records included. To make room a put
evicts pages in common/eviction.py's order (expired, keep=False, low priority, LRU; never pinned ones),
then reclaims dead space: empty segments go at once, others are compacted, those with the largest
dead share first (live records read, the segment unlinked, the records appended again; a crash in
between loses those pages, which a cache may). A full filesystem is handled the same way, with the
store's present size as the bound, and the write retried once; what still fails counts an error.
One process owns a directory (TP ranks: one directory each, or distinct key namespaces).
More in docs/stores.md, "Disk layout".
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdsdk.connectors.stores.base import Buffer, Hints, Store, byte_view, log
from pdsdk.connectors.stores.common.eviction import EvictionOrder
from pdsdk.connectors.stores.disk.index import Index
from pdsdk.connectors.stores.disk.io import Shared, as_buffer, fitting, write_chunks
from pdsdk.connectors.stores.disk.record import HEADER_SIZE, KEEP, PIN, checksum, header
from pdsdk.connectors.stores.disk.segment import (
    Damaged,
    Rec,
    Segment,
    bury,
    drop_old_layout,
    mark_dead,
    open_segments,
    read_record,
)

MAX_SEGMENT = 64 << 20  # compaction holds one segment's live records in memory
PARALLEL_BYTES = 128 << 10  # smaller batches: a thread hand-off costs more than it saves
BAD = -2  # a damaged record: a miss, and the record goes


class DiskStore(Store):
    def __init__(self, name: str = "disk", path: str | os.PathLike = "~/.cache/pdsdk/kv",
                 capacity_bytes: int = 16 << 30, fsync: bool = False, io_threads: int = 2,
                 segment_bytes: int | None = None):
        super().__init__(name)
        self.root = Path(path).expanduser()
        self.capacity_bytes = int(capacity_bytes)
        # A 32nd of the capacity: reclaiming dead space moves at most that much.
        self.segment_bytes = int(segment_bytes or max(1, min(MAX_SEGMENT, self.capacity_bytes // 32)))
        self.fsync = fsync
        # _wlock: one writer at a time (appends, eviction, compaction); _lock: the index, taken
        # inside _wlock where both are held, and alone by get/contains/delete.
        self._wlock = threading.Lock()
        self._lock = threading.RLock()
        self._empty()
        self.root.mkdir(parents=True, exist_ok=True)
        # Helpers checksum a put's next chunks while the caller writes (Shared), and read and
        # check a large get's pages beside the caller.
        self._helpers = max(0, io_threads - 1)  # the calling thread is one of the io_threads
        self._pool = ThreadPoolExecutor(self._helpers, f"pdsdk-{name}-io") if self._helpers else None
        self._reopen()

    # -- open -----------------------------------------------------------------------------------
    def _empty(self) -> None:
        self._eviction = EvictionOrder()
        self._index = Index(self.root, self.name, self.segment_bytes, self.fsync, self._lock, self._eviction,
                            self.record_error)

    def _reopen(self) -> None:
        """Index the records a previous process left, oldest segment first."""
        drop_old_layout(self.root, self.name)
        segments, found, errors = open_segments(self.root, self.name)
        for seg in segments:
            self._index.segments[seg.id] = seg
            self._index.disk += seg.size
        self._index.next_id = segments[-1].id + 1 if segments else 0
        for _ in range(errors):
            self.record_error()
        offset = time.monotonic() - time.time()
        for key, seg, off, size, flags, priority, expires in found:
            if key in self._index.recs:  # an older copy whose dead mark a crash lost
                mark_dead(self._index.unindex(key), self.name)
            self._index.add(key, Rec(seg, off, size))
            hints = Hints(priority=priority, pin=bool(flags & PIN), keep=bool(flags & KEEP))
            self._eviction.add(key, size, hints, expires=expires + offset if expires else None)
        for seg in list(self._index.segments.values()):
            if not seg.recs:
                self._index.retire(seg)
        if self._index.recs:
            log.info("%s: reopened %s: %d pages in %d segments", self.name, self.root, len(self._index.recs),
                     len(self._index.segments))

    # -- room -----------------------------------------------------------------------------------
    def _make_room(self, extra: int, protect, limit: int) -> tuple[bool, list, list]:
        """(both locks held) Evict and reclaim until `extra` more bytes fit under `limit`:
        (fits, victims, [(key, page, hints)] to demote). Frees what it can when it cannot."""
        demote: list = []
        over = self._index.disk + extra - limit
        if over <= 0 or extra > limit:  # fits already, or never will
            return over <= 0, [], demote
        dead = self._index.disk - self._eviction.used
        victims = self._eviction.victims(max(over - dead, 0), protect)
        for v in victims:
            rec = self._index.recs.get(v.key)
            if rec is not None and self._demote is not None and v.hints is not None:
                buf = bytearray(rec.size - HEADER_SIZE - len(v.key))
                if self._read(v.key, rec, memoryview(buf)) >= 0:
                    demote.append((v.key, buf, v.hints))
        self._index.drop(v.key for v in victims)
        # Reclaim: empty segments went with their last record; compact the rest, emptiest first.
        for seg in sorted((s for s in self._index.segments.values() if s.live < s.size),
                          key=lambda s: s.live / s.size):
            if self._index.disk + extra <= limit:
                break
            if not seg.retired:  # a compaction may have retired an empty open segment
                self._index.compact(seg)
        return self._index.disk + extra <= limit, victims, demote

    def _after_evict(self, victims: list, demote: list) -> None:
        self.record_evictions(victims)
        if self._demote is not None:
            for key, page, hints in demote:
                self._demote(key, memoryview(page), hints)

    # -- put ------------------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], pages: Sequence[Buffer], hints: Hints | None = None) -> int:
        """Room for the batch (never evicting the batch itself); then its records, chunk by chunk,
        checksummed by helpers ahead of the writes, each chunk indexed once written, so LRU
        order is the batch's order. A page that finds no room cuts the batch: later pages would
        be unreachable."""
        hints = hints or Hints()
        keys = [k if type(k) is bytes else bytes(k) for k in keys[: len(pages)]]
        views = [as_buffer(p) for p in pages[: len(keys)]]
        batch = set(keys)
        todo, seen = [], set()
        with self._lock:
            for i, key in enumerate(keys):
                # content-addressed: a stored key holds the same bytes
                if key not in seen and (key not in self._index.recs or self._eviction.expired(key)):
                    todo.append(i)
                seen.add(key)
        sizes = [HEADER_SIZE + len(keys[i]) + views[i].nbytes for i in todo]
        chunks = write_chunks(sizes, self.segment_bytes)
        crcs = Shared(lambda c: [checksum(views[todo[j]]) for j in range(*chunks[c])], len(chunks),
                       self._pool, self._helpers if sum(sizes) >= PARALLEL_BYTES else 0)
        written = 0  # how many of todo are stored, in order
        try:
            with self._wlock:
                with self._lock:
                    want = fitting(sizes, self.capacity_bytes)  # more never fits
                    _, victims, demote = self._make_room(sum(sizes[:want]), batch, self.capacity_bytes)
                    n = fitting(sizes, self.capacity_bytes - self._index.disk)
                self._after_evict(victims, demote)
                if n < len(todo):
                    log.warning("%s: no room for %d of %d pages (capacity %d, the rest pinned or in this batch)",
                                self.name, len(todo) - n, len(keys), self.capacity_bytes)
                flags = (PIN if hints.pin else 0) | (KEEP if hints.keep else 0)
                priority = max(-32768, min(32767, hints.priority))
                expires = time.time() + hints.ttl_s if hints.ttl_s is not None else 0.0
                for c, (a, b) in enumerate(chunks):
                    b = min(b, n)
                    if b <= a:
                        break
                    sums = crcs.result(c)
                    parts = []
                    for j in range(a, b):
                        i = todo[j]
                        parts += (header(keys[i], views[i].nbytes, sums[j - a], flags, priority, expires), views[i])
                    placed = self._write_chunk(parts, sum(sizes[a:b]), batch)
                    if placed is None:
                        break
                    seg, off = placed
                    with self._lock:
                        for j in range(a, b):
                            key = keys[todo[j]]
                            if key in self._index.recs:  # an expired copy, or a concurrent put's
                                self._index.drop([key])
                            self._index.add(key, Rec(seg, off, sizes[j]))
                            self._eviction.add(key, sizes[j], hints)
                            off += sizes[j]
                        written = b
        finally:
            crcs.stop()
        stored = todo[written] if written < len(todo) else len(keys)  # the others were there already
        self.record_put(stored, sum(views[i].nbytes for i in todo[:written]))
        return stored

    def _write_chunk(self, parts: list, nbytes: int, batch: set) -> tuple[Segment, int] | None:
        """(_wlock held) Append a chunk; on a full filesystem, free twice its size and retry once."""
        for attempt in (1, 2):
            try:
                return self._index.append(parts, nbytes)
            except OSError as e:
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                if full and attempt == 1:
                    with self._lock:  # the filesystem holds no more than we have now
                        disk = self._index.disk
                        freed, victims, demote = self._make_room(min(2 * nbytes, disk), batch, disk)
                    self._after_evict(victims, demote)
                    if victims or freed:
                        continue
                self.record_error()
                log.warning("%s: cannot write %d bytes of pages to %s: %s", self.name, nbytes, self.root, e)
                return None
        return None

    # -- get ------------------------------------------------------------------------------------
    def get(self, keys: Sequence[bytes], out: Sequence[Buffer]) -> int:
        keys = [bytes(k) for k in keys]
        recs = []
        with self._lock:
            for key in keys[: len(out)]:
                rec = self._alive(key, touch=True)
                if rec is None:
                    break
                recs.append(rec)
            segs = {rec.seg.id: rec.seg for rec in recs}.values()
            for seg in segs:
                seg.readers += 1
        try:
            views = [byte_view(b) for b in out[: len(recs)]]
            reads = Shared(lambda i: self._read(keys[i], recs[i], views[i]), len(recs), self._pool,
                            self._helpers if sum(r.size for r in recs) >= PARALLEL_BYTES else 0)
            got = [reads.result(i) for i in range(len(recs))]
        finally:
            with self._lock:
                for seg in segs:
                    seg.readers -= 1
                    if seg.retired and not seg.readers:
                        os.close(seg.fd)
        hits = next((i for i, n in enumerate(got) if n < 0), len(got))
        bad = [(keys[i], recs[i]) for i, n in enumerate(got) if n == BAD]
        if bad:
            self._drop_bad(bad)
        self.record_get(hits, len(keys), sum(got[:hits]))
        return hits

    def _alive(self, key: bytes, touch: bool) -> Rec | None:
        """(_lock held) The page's record, or None when absent or expired (then dropped)."""
        rec = self._index.recs.get(key)
        if rec is None:
            return None
        if self._eviction.expired(key):
            self._index.drop([key])
            self.record_evict(1, 0, "ttl")
            return None
        if touch:
            self._eviction.touch(key)
        return rec

    def _read(self, key: bytes, rec: Rec, view: memoryview) -> int:
        """Read a record's payload into `view` and verify it: its length, -1 (does not fit) or BAD."""
        length = rec.size - HEADER_SIZE - len(key)
        if length > len(view):
            log.warning("%s: page of %d bytes does not fit a %d-byte buffer", self.name, length, len(view))
            return -1
        try:
            return read_record(rec, key, view[:length])
        except Damaged as e:
            return self._bad(str(e))

    def _bad(self, why: str) -> int:
        log.warning("%s: %s; treated as a miss and dropped", self.name, why)
        self.record_error()
        return BAD

    def _drop_bad(self, bad: list) -> None:
        """Drop damaged records. A segment file cut short loses every record from the first one
        past its end, and is cut at a record boundary (appends go on from one); a record whose
        bytes are all there gets a fresh dead header, so that a later scan can step over it."""
        with self._wlock, self._lock:  # _wlock: a put may be appending to that segment
            for key, rec in bad:
                if self._index.recs.get(key) is not rec:
                    continue  # stored again or dropped meanwhile
                seg = rec.seg
                try:
                    size = os.fstat(seg.fd).st_size
                except OSError:
                    size = seg.size
                if size < seg.size:
                    self._index.cut(seg, size)
                if self._index.recs.get(key) is rec:
                    self._index.forget(key)
                    if not seg.retired:
                        bury(rec, key, self.name)

    # -- the rest -------------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> int:
        n = 0
        with self._lock:
            for key in keys:
                if self._alive(bytes(key), touch=False) is None:
                    break
                n += 1
        return n

    def delete(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            return self._index.drop(map(bytes, keys))

    def close(self) -> None:
        """Stop the pool and close the segment files; the pages stay for the next open."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        with self._wlock, self._lock:
            for seg in self._index.segments.values():
                seg.retired = True
                if not seg.readers:
                    os.close(seg.fd)
            self._empty()

    def stats(self) -> dict:
        with self._lock:
            index = self._index
            used, pages, disk, segments = self._eviction.used, len(index.recs), index.disk, len(index.segments)
        return {**super().stats(), "used_bytes": used, "pages": pages, "disk_bytes": disk, "segments": segments,
                "capacity_bytes": self.capacity_bytes, "path": str(self.root)}
