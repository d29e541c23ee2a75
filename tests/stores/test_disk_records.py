"""Damaged record headers and state bytes found when a disk store opens its segments: a damaged
record loses that record only (the scan goes on at the next intact header), and a deleted record
stays deleted whatever a flipped bit in its state byte says."""

from __future__ import annotations

import logging
import struct
import zlib

import pytest
from helpers import read_pages
from pdsdk.connectors.stores.disk.record import FIELDS, HEADER_SIZE, STATE_AT
from pdsdk.connectors.stores.disk.store import DiskStore
from stores.test_disk import PAGE, RECORD, damage, keys, pages, segments, where

# Spots in a record's header and key: (offset in the record, bytes of the field).
HEADER_SPOTS = {"magic": (1, 1), "version": (5, 1), "priority": (7, 2), "expiry": (9, 8), "length": (17, 8),
                "payload crc": (25, 4), "key length": (29, 2), "header crc": (31, 4), "key": (HEADER_SIZE + 5, 1)}


def _flip(path, offset, bit=0):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


@pytest.mark.parametrize("spot", sorted(HEADER_SPOTS))
@pytest.mark.parametrize("victim", [0, 36, 72])
def test_one_flipped_header_bit_loses_that_record_only(tmp_path, caplog, spot, victim):
    """The review's case: a bit flipped in the first record header of a 73-page segment cut the
    segment at 0 and deleted the file, losing 72 intact pages."""
    ks, ps = keys(73, "hdr"), pages(73)
    with DiskStore(path=tmp_path) as s:
        s.put(ks, ps)
        seg, off, _ = where(s, ks[victim])
    at, width = HEADER_SPOTS[spot]
    _flip(seg, off + at + width - 1, bit=3)
    with caplog.at_level(logging.WARNING, logger="pdsdk.stores"), DiskStore(path=tmp_path) as s:
        assert s.contains(ks[victim:victim + 1]) == 0 and s.stats()["errors"] == 1
        said = "cut there" if victim == 72 else "skipped"  # damage in the last record reads as a torn append
        assert any(said in r.getMessage() for r in caplog.records)
        rest = [i for i in range(73) if i != victim]
        for i in rest:
            assert read_pages(s, [ks[i]], PAGE) == (1, [ps[i]])
        assert seg.exists() and s.stats()["pages"] == 72
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pdsdk.stores"), DiskStore(path=tmp_path) as s:
        assert s.stats()["pages"] == 72 and s.stats()["errors"] == 0  # stepped over quietly now
        assert not caplog.records
        assert s.put(ks, ps) == 73 and read_pages(s, ks, PAGE) == (73, ps)


def test_damaged_records_with_a_torn_tail(tmp_path):
    """Two damaged headers in the middle and a torn append at the end: the middle ones are stepped
    over, the tail is cut, and appends go on after the last whole record."""
    ks, ps = keys(10, "mix"), pages(10)
    with DiskStore(path=tmp_path) as s:
        s.put(ks, ps)
        seg, last, _ = where(s, ks[9])
        spots = [where(s, ks[i])[1] for i in (2, 5)]
    for off in spots:
        damage(seg, off, b"XXXX")
    damage(seg, 0, cut=last + RECORD // 2)
    with DiskStore(path=tmp_path) as s:
        assert [i for i in range(10) if s.contains([ks[i]])] == [0, 1, 3, 4, 6, 7, 8]
        assert seg.stat().st_size == last and s.stats()["errors"] == 3
        assert s.put(ks, ps) == 10
    with DiskStore(path=tmp_path) as s:
        assert read_pages(s, ks, PAGE) == (10, ps)


@pytest.mark.parametrize("bit", range(8))
def test_deleted_stays_deleted_whatever_one_state_bit_says(tmp_path, bit):
    ks, ps = keys(3, "dead"), pages(3)
    with DiskStore(path=tmp_path) as s:
        s.put(ks, ps)
        assert s.delete(ks[1:2]) == 1
        seg, off, _ = where(s, ks[0])
    _flip(seg, off + RECORD + STATE_AT, bit)
    with DiskStore(path=tmp_path) as s:
        assert s.contains(ks[1:2]) == 0
        assert read_pages(s, ks, PAGE) == (1, ps[:1]) and read_pages(s, ks[2:], PAGE) == (1, ps[2:])


def test_live_record_with_a_damaged_state_byte_is_dropped(tmp_path):
    ks, ps = keys(3, "state"), pages(3)
    with DiskStore(path=tmp_path) as s:
        s.put(ks, ps)
        seg, off, _ = where(s, ks[1])
    _flip(seg, off + STATE_AT, 0)
    with DiskStore(path=tmp_path) as s:
        assert [s.contains([k]) for k in ks] == [1, 0, 1] and s.stats()["errors"] == 1


def test_segment_of_an_older_format_version_is_dropped(tmp_path, caplog):
    ks, ps = keys(3, "v2"), pages(3)
    with DiskStore(path=tmp_path) as s:
        s.put(ks, ps)
    seg = segments(tmp_path)[0]
    data = bytearray(seg.read_bytes())
    for i in range(3):  # rewrite each header as version 2, with a valid header checksum
        off = i * RECORD
        fields = bytearray(data[off + 5:off + 5 + FIELDS.size])
        fields[0] = 2
        key = bytes(data[off + HEADER_SIZE:off + HEADER_SIZE + 32])
        data[off + 5:off + HEADER_SIZE] = bytes(fields) + struct.pack("<I", zlib.crc32(key, zlib.crc32(fields)))
    seg.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO, logger="pdsdk.stores"), DiskStore(path=tmp_path) as s:
        assert s.contains(ks[:1]) == 0 and s.stats()["errors"] == 0 and not seg.exists()
        assert any("older format version" in r.getMessage() for r in caplog.records)
        assert s.put(ks, ps) == 3 and read_pages(s, ks, PAGE) == (3, ps)


def test_damaged_record_in_a_file_cut_short_while_open(tmp_path):
    """Found by the fuzz tier: a bad record read while its file had been cut short (by one byte,
    inside a dead record) raised from get, and the bad record stayed indexed, so it was never
    stored again."""
    ks, ps = keys(4, "short"), pages(4)
    s = DiskStore(path=tmp_path)
    s.put(ks, ps)
    s.delete(ks[3:])
    seg, off, size = where(s, ks[1])
    damage(seg, off + size - 1, bytes([ps[1][-1] ^ 1]))
    damage(seg, 0, cut=seg.stat().st_size - 1)
    assert read_pages(s, ks, PAGE) == (1, ps[:1])
    assert [s.contains([k]) for k in ks] == [1, 0, 1, 0]
    assert s.put(ks, ps) == 4 and read_pages(s, ks, PAGE) == (4, ps)
    s.close()
    with DiskStore(path=tmp_path) as s:
        assert read_pages(s, ks, PAGE) == (4, ps)
