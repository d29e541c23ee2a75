"""`disk`: one file per page under a directory, bounded in bytes, evicted by hint-aware LRU.

A page file is a fixed header (magic, hints, absolute expiry, length, CRC-32 of the payload, the
full key) followed by the payload. Writes go to a temporary file that is renamed into place, so a
reader never sees half a page; the checksum catches everything else (a torn write after a power
cut, a truncated or corrupted file): such a page is a miss plus a log line, and is removed.
No fsync by default: a cache may lose pages in a crash, it must never return wrong ones.
One process owns a directory (TP ranks: one directory each, or distinct key namespaces).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import struct
import threading
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
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
PARALLEL_BYTES = 1 << 20  # smaller batches: thread hand-offs cost more than they save


class DiskStore(Store):
    def __init__(self, name: str = "disk", path: str | os.PathLike = "~/.cache/pdsdk/kv",
                 capacity_bytes: int = 16 << 30, fsync: bool = False, io_threads: int = 2):
        super().__init__(name)
        self.root = Path(path).expanduser()
        self.capacity_bytes = int(capacity_bytes)
        self.fsync = fsync
        self._tmp = self.root / ".tmp"
        self._lock = threading.Lock()
        self._retention = Retention()
        self._reserved = 0  # bytes of pages being written, counted against capacity
        self._tmp.mkdir(parents=True, exist_ok=True)
        # CRC-32 and file I/O release the GIL: a batch's pages are checksummed and written (or
        # read) by a few threads at once, so the checksum hides behind the I/O.
        self._pool = ThreadPoolExecutor(io_threads, f"pdsdk-{name}-io") if io_threads > 1 else None
        self._dirs: set[str] = set()
        self._reopen()

    # -- layout ---------------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        digest = hashlib.blake2b(key, digest_size=20).hexdigest()  # the header holds the full key
        return self.root / digest[:2] / (digest + SUFFIX)

    def _map(self, fn, *iterables, big: bool = True) -> list:
        if self._pool is None or not big:
            return list(map(fn, *iterables))
        return list(self._pool.map(fn, *iterables))

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
        """Three phases: room for the batch, in order (never evicting the batch itself); the files,
        in parallel; then renames into place and index entries, in order, so LRU order is the
        batch's order. A page that finds no room cuts the batch: later pages would be unreachable."""
        hints = hints or Hints()
        keys = [bytes(k) for k in keys[: len(pages)]]
        views = [byte_view(p) for p in pages[: len(keys)]]
        batch = set(keys)
        with self._lock:
            known = [k in self._retention and not self._retention.expired(k) for k in keys]
        sizes = [HEADER.size + len(k) + len(v) for k, v in zip(keys, views)]
        todo = []
        for i, key in enumerate(keys):
            if known[i]:
                continue  # content-addressed: a stored key holds the same bytes
            if not self._reserve(sizes[i], batch):
                log.warning("%s: no room for a %d-byte page (capacity %d, rest pinned)", self.name, sizes[i],
                            self.capacity_bytes)
                break
            todo.append(i)
        files = self._map(lambda i: self._write(keys[i], views[i], hints, sizes[i], batch), todo,
                          big=len(todo) > 1 and sum(sizes) >= PARALLEL_BYTES)
        ok = dict.fromkeys(range(len(keys)), False)
        with self._lock:
            for i, tmp in zip(todo, files):
                self._reserved -= sizes[i]
                if tmp is not None:
                    try:
                        os.replace(tmp, self._path(keys[i]))
                        self._retention.add(keys[i], sizes[i], hints)
                        ok[i] = True
                    except OSError as e:
                        os.unlink(tmp)
                        self._record_error()
                        log.warning("%s: cannot rename a page into place: %s", self.name, e)
        stored = next((i for i in range(len(keys)) if not (known[i] or ok[i])), len(keys))
        self._record_put(stored, sum(len(views[i]) for i in range(stored) if ok[i]))
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

    def _write(self, key: bytes, view: memoryview, hints: Hints, size: int, batch: set[bytes]) -> str | None:
        """Checksum and write one page to a temporary file; its path, or None on failure."""
        header = self._header(key, len(view), zlib.crc32(view), hints)
        final = self._path(key)
        tmp = str(self._tmp / f"{final.name}.{threading.get_ident()}")
        if final.parent.name not in self._dirs:
            final.parent.mkdir(exist_ok=True)
            self._dirs.add(final.parent.name)
        for attempt in (1, 2):
            try:
                self._write_file(tmp, header, view)
                return tmp
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                if not full or attempt == 2 or not self._free_for(size, batch):
                    self._record_error()
                    log.warning("%s: cannot write a page to %s: %s", self.name, self.root, e)
                    return None
        return None

    def _write_file(self, tmp: str, header: bytes, view: memoryview) -> None:
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
        keys = [bytes(k) for k in keys]
        alive = 0
        for key in keys[: len(out)]:
            if not self._alive(key, touch=True):
                break
            alive += 1
        views = [byte_view(b) for b in out[:alive]]
        got = self._map(self._read_into, keys[:alive], views,
                        big=alive > 1 and sum(len(v) for v in views) >= PARALLEL_BYTES)
        hits = next((i for i, n in enumerate(got) if n < 0), len(got))
        nbytes = sum(got[:hits])
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

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def stats(self) -> dict:
        with self._lock:
            used, pages = self._retention.used, len(self._retention)
        return {**super().stats(), "used_bytes": used, "pages": pages, "capacity_bytes": self.capacity_bytes,
                "path": str(self.root)}
