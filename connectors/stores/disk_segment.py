"""The disk store's segment files: a segment and its records in memory, reading a segment's records
back on open (headers only), and removing the pre-segment layout. The store is in disk.py."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

from pdsdk.connectors.stores.base import log
from pdsdk.connectors.stores.disk_record import FIELDS, HEADER_SIZE, LIVE, parse

SUFFIX = ".seg"
SEGMENT_NAME = re.compile(r"[0-9a-f]{8}\.seg")


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



def scan(seg: Segment, store: str) -> tuple[list[tuple], int]:
    """(the live records of a segment, damaged spots found), reading headers only (payloads are
    checked on read). A record that is cut short or whose header is damaged ends the segment there."""
    size = os.fstat(seg.fd).st_size
    off, found, errors = 0, [], 0
    while off < size:
        try:
            head = os.pread(seg.fd, HEADER_SIZE + 64, off)
            if len(head) >= HEADER_SIZE and FIELDS.unpack_from(head, 5)[-1] > 64:  # a long key
                head = os.pread(seg.fd, HEADER_SIZE + FIELDS.unpack_from(head, 5)[-1], off)
        except OSError as e:  # keep what was found; nothing is appended to an old segment
            log.warning("%s: cannot read %s at offset %d: %s", store, seg.path, off, e)
            errors += 1
            off = size
            break
        rec = parse(head)
        end = off + HEADER_SIZE + len(rec[6]) + rec[4] if rec else size + 1
        if end > size:
            log.warning("%s: %s has a torn or damaged record at offset %d: cut there (%d bytes dropped)",
                        store, seg.path, off, size - off)
            errors += 1
            try:
                os.ftruncate(seg.fd, off)
            except OSError as e:
                log.warning("%s: cannot cut %s: %s", store, seg.path, e)
                off = size  # the garbage stays counted, and nothing is appended after it
            break
        state, flags, priority, expires, _length, _crc, key = rec
        if state == LIVE:
            found.append((key, seg, off, end - off, flags, priority, expires))
        off = end
    seg.size = off
    return found, errors



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
