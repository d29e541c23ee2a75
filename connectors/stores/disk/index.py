"""The disk store's index: which record of which segment file holds each page, and the segment files'
lifecycle (start, append, cut a torn tail, retire, compact). Callers hold the store's locks as each
method says; the store (room, put/get) is in store.py."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from pdsdk.connectors.stores.base import log
from pdsdk.connectors.stores.common.eviction import EvictionOrder
from pdsdk.connectors.stores.disk.io import CHUNK_RECORDS, pwrite_all
from pdsdk.connectors.stores.disk.segment import SUFFIX, Rec, Segment, mark_dead


class Index:
    def __init__(self, root: Path, name: str, segment_bytes: int, fsync: bool, lock: threading.RLock,
                 eviction: EvictionOrder, on_error: Callable[[], None]):
        self.root, self.name, self.segment_bytes, self.fsync = root, name, segment_bytes, fsync
        self._lock = lock  # the store's index lock
        self._eviction = eviction
        self._on_error = on_error  # counts a lost record in the store's stats
        self.recs: dict[bytes, Rec] = {}
        self.segments: dict[int, Segment] = {}
        self.active: Segment | None = None  # the segment puts append to
        self.disk = 0  # bytes of all segment files
        self.next_id = 0

    # -- the index (callers hold _lock) -----------------------------------------------------------
    def add(self, key: bytes, rec: Rec) -> None:
        self.recs[key] = rec
        rec.seg.recs[key] = rec
        rec.seg.live += rec.size

    def unindex(self, key: bytes) -> Rec | None:
        rec = self.recs.pop(key, None)
        if rec is not None:
            del rec.seg.recs[key]
            rec.seg.live -= rec.size
        return rec

    def forget(self, key: bytes) -> Rec | None:
        """Drop a page from the index, and its segment once empty: its record, if it was there."""
        self._eviction.remove(key)
        rec = self.unindex(key)
        if rec is not None and not rec.seg.recs and rec.seg is not self.active:
            self.retire(rec.seg)
        return rec

    def drop(self, keys) -> int:
        """Forget pages and mark their records dead on disk (those whose segment is still there,
        after all the keys: a delete of whole segments writes nothing); how many were stored."""
        recs = [rec for rec in map(self.forget, keys) if rec is not None]
        for rec in recs:
            if not rec.seg.retired:
                mark_dead(rec, self.name)
        return len(recs)

    def retire(self, seg: Segment) -> None:
        """Unlink a segment (its records are gone from the index or are being moved)."""
        for key in list(seg.recs):
            self.unindex(key)
        del self.segments[seg.id]
        if seg is self.active:
            self.active = None
        self.disk -= seg.size
        seg.retired = True
        try:
            seg.path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("%s: cannot remove %s: %s", self.name, seg.path, e)
        if not seg.readers:
            os.close(seg.fd)

    def open_segment(self) -> Segment:
        path = self.root / f"{self.next_id:08x}{SUFFIX}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        if self.fsync:
            dfd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        with self._lock:
            seg = Segment(self.next_id, path, fd)
            self.next_id += 1
            self.segments[seg.id] = seg
            old, self.active = self.active, seg
            if old is not None and not old.recs:
                self.retire(old)
        return seg

    def append(self, parts: list, nbytes: int) -> tuple[Segment, int]:
        """(_wlock held) Write records at the end of the open segment, starting a new one when it
        is full: (segment, offset). Raises OSError, after cutting off what was partly written."""
        seg = self.active
        if seg is None or seg.size >= self.segment_bytes:
            seg = self.open_segment()
        off = seg.size
        try:
            pwrite_all(seg.fd, parts, off)
            if self.fsync:
                os.fdatasync(seg.fd)
        except OSError:
            try:
                os.ftruncate(seg.fd, off)
            except OSError:
                with self._lock:  # nothing more goes after the garbage
                    self.active = None
                    seg.size = os.fstat(seg.fd).st_size
                    self.disk += seg.size - off
            raise
        with self._lock:
            seg.size += nbytes
            self.disk += nbytes
        return seg, off

    def compact(self, seg: Segment) -> None:
        """(both locks held) Move a segment's live records to the open segment, then unlink it;
        the records are held in memory in between, so this needs no room on disk."""
        moving = []
        for key, rec in sorted(seg.recs.items(), key=lambda kv: kv[1].off):
            try:
                data = os.pread(seg.fd, rec.size, rec.off)
            except OSError as e:
                data = str(e)
            if len(data) == rec.size:
                moving.append((key, data))  # checked when read, like any record
            else:
                self._eviction.remove(key)
                self._on_error()
                log.warning("%s: cannot read a record to move from %s (%s); the page is lost", self.name,
                            seg.path, data if isinstance(data, str) else "truncated")
        self.retire(seg)
        for i in range(0, len(moving), CHUNK_RECORDS):
            part = moving[i:i + CHUNK_RECORDS]
            sizes = [len(d) for _, d in part]
            try:
                into, off = self.append([d for _, d in part], sum(sizes))
            except OSError as e:
                self._on_error()
                log.warning("%s: compaction lost %d pages: %s", self.name, len(part), e)
                for key, _ in part:
                    self._eviction.remove(key)
                continue
            for (key, _), size in zip(part, sizes):
                self.add(key, Rec(into, off, size))
                off += size

    def cut(self, seg: Segment, size: int) -> None:
        """(both locks held) Cut a segment whose file is now `size` bytes at the last record
        boundary before its end, dropping the records past it."""
        past = [r.off for r in seg.recs.values() if r.off + r.size > size]
        cut = min(past) if past else max((r.off + r.size for r in seg.recs.values()), default=0)
        for k, r in list(seg.recs.items()):
            if r.off >= cut:
                self.forget(k)
        if seg.retired:
            return
        try:
            os.ftruncate(seg.fd, cut)
        except OSError:
            cut = size
            if seg is self.active:
                self.active = None  # nothing more goes after the torn record
        self.disk -= seg.size - cut
        seg.size = cut
