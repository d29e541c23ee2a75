"""The disk store's segment files: a segment and its records in memory, opening a directory's
segments and reading their records back (headers only), reading and verifying one record, marking
records dead, and removing the pre-segment layout. The index is in index.py, the store in store.py."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

from pdsdk.connectors.stores.base import log
from pdsdk.connectors.stores.disk.record import (
    DEAD,
    FIELDS,
    HEADER_SIZE,
    LIVE,
    MAGIC,
    STATE_AT,
    VERSION,
    Head,
    checksum,
    dead_header,
    parse,
)

SUFFIX = ".seg"
SEGMENT_NAME = re.compile(r"[0-9a-f]{8}\.seg")
RESYNC_CHUNK = 1 << 20  # bytes searched per read for the next record header after a damaged one


class Segment:
    __slots__ = ("fd", "id", "live", "path", "readers", "recs", "retired", "size")

    def __init__(self, sid: int, path: Path, fd: int, size: int = 0):
        self.id, self.path, self.fd, self.size = sid, path, fd, size
        self.live = 0  # bytes of live records
        self.recs: dict[bytes, Rec] = {}  # its live records
        self.readers = 0  # gets reading it outside the lock: its fd closes when they are done
        self.retired = False


class Rec:
    __slots__ = ("off", "seg", "size")

    def __init__(self, seg: Segment, off: int, size: int):
        self.seg, self.off, self.size = seg, off, size


class Damaged(Exception):
    """A record that cannot be trusted; the message says where and why."""


def open_segments(root: Path, store: str) -> tuple[list[Segment], list[tuple], int]:
    """(the segments under `root`, oldest first; their live records; damaged spots found)."""
    segments, found, errors = [], [], 0
    for path in sorted(p for p in root.iterdir() if SEGMENT_NAME.fullmatch(p.name)):
        try:
            seg = Segment(int(path.stem, 16), path, os.open(path, os.O_RDWR))
        except OSError as e:
            log.warning("%s: cannot open %s: %s", store, path, e)
            continue
        records, bad = scan(seg, store)
        segments.append(seg)
        found += records
        errors += bad
    return segments, found, errors


def scan(seg: Segment, store: str) -> tuple[list[tuple], int]:
    """(the live records of a segment, damaged spots found), reading headers only (payloads are
    checked on read). A damaged record is stepped over to the next intact record header, and a
    dead header is laid over it so that later scans step over it quietly; damage with no intact
    record after it (a torn append) is cut off. Records of an older format version are dropped."""
    size = os.fstat(seg.fd).st_size
    off, found, errors, old = 0, [], 0, 0
    while off < size:
        try:
            rec = read_head(seg.fd, off)
            end = off + rec.size if rec else size + 1
            resume = next_record(seg.fd, off + 1, size) if end > size else end
        except OSError as e:  # keep what was found; nothing is appended to an old segment
            log.warning("%s: cannot read %s at offset %d: %s", store, seg.path, off, e)
            errors += 1
            off = size
            break
        if resume is None:
            log.warning("%s: %s has a torn or damaged record at offset %d: cut there (%d bytes dropped)",
                        store, seg.path, off, size - off)
            errors += 1
            try:
                os.ftruncate(seg.fd, off)
            except OSError as e:
                log.warning("%s: cannot cut %s: %s", store, seg.path, e)
                off = size  # the garbage stays counted, and nothing is appended after it
            break
        if end > size:
            log.warning("%s: %s has a damaged record at offset %d: %d bytes skipped to the next record",
                        store, seg.path, off, resume - off)
            errors += 1
            if resume - off >= HEADER_SIZE:
                _overwrite(seg, off, dead_header(b"", resume - off - HEADER_SIZE), store)
        elif rec.version != VERSION:
            old += 1
        elif rec.state == LIVE:
            found.append((rec.key, seg, off, end - off, rec.flags, rec.priority, rec.expires))
        elif rec.state != DEAD:  # neither: read as dead
            log.warning("%s: %s has a damaged state byte at offset %d: the record is dropped", store, seg.path, off)
            errors += 1
        off = resume
    if old:
        log.info("%s: %s: dropped %d records of an older format version", store, seg.path, old)
    seg.size = off
    return found, errors


def read_head(fd: int, off: int) -> Head | None:
    """The intact record header and key at `off`, or None. Raises OSError."""
    head = os.pread(fd, HEADER_SIZE + 64, off)
    if len(head) >= HEADER_SIZE and FIELDS.unpack_from(head, 5)[-1] > 64:  # a long key
        head = os.pread(fd, HEADER_SIZE + FIELDS.unpack_from(head, 5)[-1], off)
    return parse(head)


def next_record(fd: int, start: int, size: int) -> int | None:
    """The offset of the first intact record header from `start` whose record ends by `size`;
    None when there is none. Raises OSError."""
    for base in range(start, size, RESYNC_CHUNK):
        chunk = os.pread(fd, RESYNC_CHUNK + len(MAGIC) - 1, base)
        at = chunk.find(MAGIC)
        while at >= 0:
            rec = read_head(fd, base + at)
            if rec is not None and base + at + rec.size <= size:
                return base + at
            at = chunk.find(MAGIC, at + 1)
    return None


def read_record(rec: Rec, key: bytes, payload: memoryview) -> int:
    """Read a record into `payload` (exactly its length) and verify its header, key, length and
    checksum: the length. Raises Damaged."""
    head = bytearray(HEADER_SIZE + len(key))
    where = f"{rec.seg.path} (record at offset {rec.off})"
    try:
        got = os.preadv(rec.seg.fd, [head, payload], rec.off)
    except OSError as e:
        raise Damaged(f"cannot read {where}: {e}") from None
    if got != rec.size:
        raise Damaged(f"{where} is truncated ({got} of {rec.size} bytes)")
    parsed = parse(head)
    if parsed is None or parsed.version != VERSION or parsed.key != key or parsed.length != len(payload):
        raise Damaged(f"{where} has a bad header")
    if checksum(payload) != parsed.crc:
        raise Damaged(f"{where} fails its checksum")
    return len(payload)


def mark_dead(rec: Rec, store: str) -> None:
    """Set a record's state byte to dead, so that a reopened store skips it."""
    try:
        os.pwrite(rec.seg.fd, DEAD, rec.off + STATE_AT)
    except OSError as e:  # it only comes back after a restart
        log.warning("%s: cannot mark a record dead in %s: %s", store, rec.seg.path, e)


def bury(rec: Rec, key: bytes, store: str) -> None:
    """Overwrite a damaged record's header and key with intact ones, marked dead, so that a later
    scan steps over it."""
    _overwrite(rec.seg, rec.off, dead_header(key, rec.size - HEADER_SIZE - len(key)), store)


def _overwrite(seg: Segment, off: int, data: bytes, store: str) -> None:
    try:
        os.pwrite(seg.fd, data, off)
    except OSError as e:
        log.warning("%s: cannot mark a damaged record dead in %s: %s", store, seg.path, e)


def drop_old_layout(root: Path, store: str) -> None:
    """Remove page files of the one-file-per-page layout (before segments), if any."""
    old = list(root.glob("[0-9a-f][0-9a-f]/" + "[0-9a-f]" * 40 + ".kv"))
    for f in old:
        with contextlib.suppress(OSError):
            f.unlink(missing_ok=True)
    for d in {f.parent for f in old}:
        with contextlib.suppress(OSError):
            d.rmdir()
    shutil.rmtree(root / ".tmp", ignore_errors=True)
    if old:
        log.info("%s: removed %d page files of the old file-per-page layout", store, len(old))
