"""`disk`: one file per page under a directory, bounded in bytes, evicted by hint-aware LRU.

A page file is a fixed header (magic, hints, absolute expiry, length, CRC-32 of the payload, the
full key) followed by the payload. Writes go to a temporary file that is renamed into place, so a
reader never sees half a page; the checksum catches everything else (a torn write after a power
cut, a truncated or corrupted file): such a page is a miss plus a log line, and is removed.
No fsync by default: a cache may lose pages in a crash, it must never return wrong ones.
One process owns a directory (TP ranks: one directory each, or distinct key namespaces).
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
import threading
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

from pdsdk.connectors.stores.base import Buffer, Hints, Store, byte_view, log
from pdsdk.connectors.stores.retention import Retention

MAGIC = b"PDKV"
VERSION = 1
# magic, version, flags (1 pin, 2 keep), priority, expiry (unix time, 0 none), length, crc32, key length
HEADER = struct.Struct("<4sBBhdQIH")
PIN, KEEP = 1, 2
SUFFIX = ".kv"
BAD = -2  # a damaged page file: a miss, and the file goes


class DiskStore(Store):
    def __init__(self, name: str = "disk", path: str | os.PathLike = "~/.cache/pdsdk/kv",
                 capacity_bytes: int = 16 << 30, fsync: bool = False):
        super().__init__(name)
        self.root = Path(path).expanduser()
        self.capacity_bytes = int(capacity_bytes)
        self.fsync = fsync
        self._tmp = self.root / ".tmp"
        self._lock = threading.Lock()
        self._retention = Retention()
        self._reserved = 0  # bytes of pages being written, counted against capacity
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._reopen()

    # -- layout ---------------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        digest = hashlib.blake2b(key, digest_size=20).hexdigest()  # the header holds the full key
        return self.root / digest[:2] / (digest + SUFFIX)

    @staticmethod
    def _header(key: bytes, length: int, crc: int, hints: Hints) -> bytes:
        flags = (PIN if hints.pin else 0) | (KEEP if hints.keep else 0)
        expires = time.time() + hints.ttl_s if hints.ttl_s is not None else 0.0
        priority = max(-32768, min(32767, hints.priority))
        return HEADER.pack(MAGIC, VERSION, flags, priority, expires, length, crc, len(key)) + key

    def _reopen(self) -> None:
        """Find the pages a previous process left, oldest first, so LRU order survives."""
        for stale in self._tmp.iterdir():
            stale.unlink(missing_ok=True)
        found = []
        for sub in self.root.iterdir():
            if sub.is_dir() and len(sub.name) == 2:
                for f in sub.iterdir():
                    if f.suffix == SUFFIX:
                        found.append(f)
        entries = []
        for f in found:
            meta = self._read_meta(f)
            if meta is None:
                log.warning("%s: dropping unreadable page file %s", self.name, f)
                f.unlink(missing_ok=True)
            else:
                entries.append((f.stat().st_mtime, meta))
        offset = time.monotonic() - time.time()
        for _, (key, hints, expires, size) in sorted(entries, key=lambda e: e[0]):
            self._retention.add(key, size, hints, expires=expires + offset if expires else None)
        if entries:
            log.info("%s: reopened %s with %d pages", self.name, self.root, len(entries))

    @staticmethod
    def _read_meta(path: Path):
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
                magic, version, flags, prio, expires, length, _crc, keylen = HEADER.unpack(head)
                key = f.read(keylen)
                size = os.fstat(f.fileno()).st_size
        except (OSError, struct.error):
            return None
        if magic != MAGIC or version != VERSION or len(key) != keylen or size != HEADER.size + keylen + length:
            return None
        hints = Hints(priority=prio, pin=bool(flags & PIN), keep=bool(flags & KEEP))
        return key, hints, expires, size

    # -- put ------------------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], pages: Sequence[Buffer], hints: Hints | None = None) -> int:
        hints = hints or Hints()
        stored = nbytes = 0
        batch: set[bytes] = set()
        for key, page in zip(keys, pages):
            key = bytes(key)
            batch.add(key)
            with self._lock:
                if key in self._retention and not self._retention.expired(key):
                    stored += 1  # content-addressed: the same key holds the same bytes
                    continue
            view = byte_view(page)
            if not self._write(key, view, hints, batch):
                break  # later pages of this prefix would be unreachable anyway
            stored, nbytes = stored + 1, nbytes + len(view)
        self._record_put(stored, nbytes)
        return stored

    def _reserve(self, size: int, batch: set[bytes]) -> bool:
        with self._lock:
            need = self._retention.used + self._reserved + size - self.capacity_bytes
            victims = self._retention.victims(max(need, 0), batch)
            moved = self._evict(victims)
            ok = self._retention.used + self._reserved + size <= self.capacity_bytes
            if ok:
                self._reserved += size
        self._after_evict(victims, moved)
        return ok

    def _evict(self, victims) -> list:
        """Remove victims' files (caller holds the lock). With a demotion sink, live victims are
        moved aside instead, to be read and handed down outside the lock."""
        moved = []
        for v in victims:
            path = self._path(v.key)
            if self._demote is not None and v.hints is not None:
                aside = self._tmp / f"{path.name}.demote.{threading.get_ident()}"
                try:
                    os.replace(path, aside)
                    moved.append((v, aside))
                    continue
                except OSError:
                    pass
            path.unlink(missing_ok=True)
        return moved

    def _after_evict(self, victims, moved) -> None:
        self._report_evictions(victims)
        for v, aside in moved:
            try:
                buf = bytearray(v.nbytes)
                n = self._read_file(aside, v.key, memoryview(buf))
                if n >= 0:
                    self._demote(v.key, memoryview(buf)[:n], v.hints)
            finally:
                aside.unlink(missing_ok=True)

    def _write(self, key: bytes, view: memoryview, hints: Hints, batch: set[bytes]) -> bool:
        header = self._header(key, len(view), zlib.crc32(view), hints)
        size = len(header) + len(view)
        if not self._reserve(size, batch):
            log.warning("%s: no room for a %d-byte page (capacity %d, rest pinned)", self.name, size,
                        self.capacity_bytes)
            return False
        final = self._path(key)
        tmp = self._tmp / f"{final.name}.{threading.get_ident()}"
        try:
            for attempt in (1, 2):
                try:
                    self._write_file(tmp, header, view)
                    break
                except OSError as e:
                    tmp.unlink(missing_ok=True)
                    if e.errno not in (errno.ENOSPC, errno.EDQUOT) or attempt == 2 or not self._free_for(size, batch):
                        raise
            final.parent.mkdir(exist_ok=True)
            with self._lock:
                os.replace(tmp, final)
                self._retention.add(key, size, hints)
            return True
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._record_error()
            log.warning("%s: cannot write a page to %s: %s", self.name, self.root, e)
            return False
        finally:
            with self._lock:
                self._reserved -= size

    def _write_file(self, tmp: Path, header: bytes, view: memoryview) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            parts = [memoryview(header), view]
            while parts:  # writev may write less than asked; go on from where it stopped
                done = os.writev(fd, parts)
                while parts and done >= len(parts[0]):
                    done -= len(parts.pop(0))
                if parts:
                    parts[0] = parts[0][done:]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _free_for(self, size: int, batch: set[bytes]) -> bool:
        """The filesystem is full before our capacity is: evict to make room for one page."""
        with self._lock:
            victims = self._retention.victims(2 * size, batch)
            moved = self._evict(victims)
        self._after_evict(victims, moved)
        return bool(victims)

    # -- get ------------------------------------------------------------------------------------
    def get(self, keys: Sequence[bytes], out: Sequence[Buffer]) -> int:
        hits = nbytes = 0
        for key, buf in zip(keys, out):
            key = bytes(key)
            if not self._alive(key, touch=True):
                break
            n = self._read_into(key, byte_view(buf))
            if n < 0:
                break
            hits, nbytes = hits + 1, nbytes + n
        self._record_get(hits, len(keys), nbytes)
        return hits

    def _alive(self, key: bytes, touch: bool) -> bool:
        with self._lock:
            if key not in self._retention:
                return False
            if self._retention.expired(key):
                self._forget(key)
                self._record_evict(1, 0, "ttl")
                return False
            if touch:
                self._retention.touch(key)
            return True

    def _read_into(self, key: bytes, view: memoryview) -> int:
        """Read a page into `view` and verify it; returns its length, or -1 for a miss."""
        n = self._read_file(self._path(key), key, view)
        if n == BAD:
            with self._lock:
                self._forget(key)
        return max(n, -1)

    def _read_file(self, path: Path, key: bytes, view: memoryview) -> int:
        """Read and verify one page file into `view`: its length, -1 (absent, too big) or BAD."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # evicted or deleted by a concurrent call
            return -1
        except OSError as e:
            return self._bad(key, f"cannot open {path}: {e}")
        try:
            head = os.pread(fd, HEADER.size + len(key), 0)
            if len(head) < HEADER.size:
                return self._bad(key, f"{path} is truncated")
            magic, version, _f, _p, _e, length, crc, keylen = HEADER.unpack_from(head)
            if magic != MAGIC or version != VERSION or head[HEADER.size:] != key:
                return self._bad(key, f"{path} has a bad header")
            if length > len(view):
                log.warning("%s: page of %d bytes does not fit a %d-byte buffer", self.name, length, len(view))
                return -1
            target = view[:length]
            got = os.preadv(fd, [target], HEADER.size + keylen)
            if got != length:
                return self._bad(key, f"{path} is truncated ({got} of {length} bytes)")
            if zlib.crc32(target) != crc:
                return self._bad(key, f"{path} fails its checksum")
            return length
        except OSError as e:
            return self._bad(key, f"cannot read {path}: {e}")
        finally:
            os.close(fd)

    def _bad(self, key: bytes, why: str) -> int:
        log.warning("%s: %s; treated as a miss and removed", self.name, why)
        self._record_error()
        return BAD

    def _forget(self, key: bytes) -> None:
        """Remove a page's file and index entry (caller holds the lock)."""
        self._retention.remove(key)
        self._path(key).unlink(missing_ok=True)

    # -- the rest -------------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if not self._alive(bytes(key), touch=False):
                break
            n += 1
        return n

    def delete(self, keys: Sequence[bytes]) -> int:
        present = 0
        with self._lock:
            for key in map(bytes, keys):
                if key in self._retention:
                    self._forget(key)
                    present += 1
        return present

    def stats(self) -> dict:
        with self._lock:
            used, pages = self._retention.used, len(self._retention)
        return {**super().stats(), "used_bytes": used, "pages": pages, "capacity_bytes": self.capacity_bytes,
                "path": str(self.root)}
