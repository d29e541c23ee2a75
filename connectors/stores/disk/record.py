"""The disk store's record format: header, key, payload, and the payload's checksum.

    header (magic, state, version, hints, absolute expiry, payload length, payload checksum,
            key length, CRC-32 of the header and key) | key | payload
The state byte sits outside the header's checksum, so delete and eviction flip it in place. A record
is live only while that byte is exactly LIVE; LIVE and DEAD differ in every bit, so no flip of a
few bits brings a deleted record back (any other value reads as dead). Version 3: these state
values; segments of older versions are dropped on open (a cache).
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

import numpy as np

MAGIC = b"PDKS"
VERSION = 3
LIVE, DEAD = b"\xa5", b"\x5a"  # the state byte, right after the magic
STATE_AT = 4
# after magic and state: version, flags (1 pin, 2 keep), priority, expiry (unix time, 0 none),
# payload length, payload checksum, key length; then the crc32 of these fields and the key
FIELDS = struct.Struct("<BBhdQIH")
CRC = struct.Struct("<I")
HEADER_SIZE = 5 + FIELDS.size + CRC.size  # 35 bytes
PIN, KEEP = 1, 2
SUM_MIN = 64 << 10  # pages from this size are checked by block sums (_checksum)
BLOCK_WORDS = 512  # a block: 4 KiB of little-endian 64-bit words


def header(key: bytes, length: int, crc: int, flags: int, priority: int, expires: float) -> bytes:
    fields = FIELDS.pack(VERSION, flags, priority, expires, length, crc, len(key))
    return b"".join((MAGIC, LIVE, fields, CRC.pack(zlib.crc32(key, zlib.crc32(fields))), key))


class Head(NamedTuple):
    state: bytes
    flags: int
    priority: int
    expires: float
    length: int  # of the payload
    crc: int  # the payload's checksum
    key: bytes
    version: int

    @property
    def size(self) -> int:
        """The whole record's bytes: header, key, payload."""
        return HEADER_SIZE + len(self.key) + self.length


def dead_header(key: bytes, length: int) -> bytes:
    """An intact header and key, marked dead, for a record of `length` payload bytes: laid over a
    damaged record so that later scans step over it."""
    head = header(key, length, 0, 0, 0, 0.0)
    return head[:STATE_AT] + DEAD + head[STATE_AT + 1:]


def parse(head: bytes) -> Head | None:
    """A record's header and key from its first bytes, or None when they are not a whole, intact
    header and key (of any version: the caller checks it)."""
    if len(head) < HEADER_SIZE or head[:4] != MAGIC:
        return None
    fields = head[5:5 + FIELDS.size]
    version, flags, priority, expires, length, crc, keylen = FIELDS.unpack(fields)
    key = bytes(head[HEADER_SIZE:HEADER_SIZE + keylen])
    if len(key) != keylen or CRC.unpack_from(head, 5 + FIELDS.size)[0] != zlib.crc32(key, zlib.crc32(fields)):
        return None
    return Head(bytes(head[STATE_AT:STATE_AT + 1]), flags, priority, expires, length, crc, key, version)


def checksum(page: memoryview) -> int:
    """A page's checksum. Below SUM_MIN, its CRC-32. From SUM_MIN, the CRC-32 of its block sums:
    the page as 4 KiB blocks of 64-bit words (mod 2^64), the sum of each block and the sum of each
    word position over the blocks, then any tail under 4 KiB. zlib's CRC-32 runs at 2-3 GB/s
    here, slower than the page cache takes writes (about 4); the sums run at 7-9 (numpy, and the
    GIL released like zlib's), so a put's checksum no longer costs more than its write.
    Any change confined to one block or to at most three words changes the sums; the CRC-32 then
    misses it with a chance of 2^-32, as it would miss random damage in the page itself. Only
    damage to four or more words whose changes cancel in both their blocks and their word
    positions goes unseen by the sums (docs/stores.md, "Disk layout")."""
    if page.nbytes < SUM_MIN:
        return zlib.crc32(page)
    data = np.frombuffer(page, np.uint8)
    bulk = data.size - data.size % (8 * BLOCK_WORDS)
    blocks = data[:bulk].view("<u8").reshape(-1, BLOCK_WORDS)
    crc = zlib.crc32(blocks.sum(axis=1).tobytes())
    crc = zlib.crc32(blocks.sum(axis=0).tobytes(), crc)
    return zlib.crc32(data[bulk:], crc)
