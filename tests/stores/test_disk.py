"""The disk store's segment files: damage, crashes, restarts, compaction, a full filesystem.

Damage is done to the files the way a crash or a bad disk would (bytes flipped, a file cut short,
a torn record at the end), found through the store's index (`_index[key]`: segment and offset).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import numpy as np
import pytest
from helpers import read_pages
from pdsdk.connectors.stores.base import Hints
from pdsdk.connectors.stores.disk.record import HEADER_SIZE
from pdsdk.connectors.stores.disk.record import checksum as _checksum
from pdsdk.connectors.stores.disk.store import DiskStore

PAGE = 4096
RECORD = HEADER_SIZE + 32 + PAGE  # a page's bytes in a segment (32-byte keys)


def pages(n, size=PAGE):
    return [os.urandom(size) for _ in range(n)]


def keys(n, salt):
    return [f"{salt}-{i}".encode().ljust(32, b".") for i in range(n)]


def where(store, key):
    """(segment path, record offset, record size) of a stored page."""
    rec = store._index.recs[key]
    return rec.seg.path, rec.off, rec.size


def segments(path):
    return sorted(p for p in path.iterdir() if p.suffix == ".seg")


def damage(path, offset, data=None, cut=None):
    with open(path, "r+b") as f:
        if data is not None:
            f.seek(offset)
            f.write(data)
        if cut is not None:
            f.truncate(cut)


def test_small_pages_share_a_segment(tmp_path):
    ks, ps = keys(64, "share"), pages(64)
    with DiskStore(path=tmp_path) as s:
        for i in range(0, 64, 16):
            assert s.put(ks[i:i + 16], ps[i:i + 16]) == 16
        assert len(segments(tmp_path)) == 1 and s.stats()["segments"] == 1
        assert s.stats()["disk_bytes"] == s.stats()["used_bytes"] == 64 * RECORD
        assert read_pages(s, ks, PAGE) == (64, ps)


def test_reopen_finds_pages_and_hints(tmp_path):
    ks, ps = keys(4, "reopen"), pages(4)
    with DiskStore(path=tmp_path, capacity_bytes=6 * (PAGE + 256)) as s:
        s.put(ks[:2], ps[:2])
        s.put(ks[2:], ps[2:], Hints(pin=True))
    with DiskStore(path=tmp_path, capacity_bytes=6 * (PAGE + 256)) as s:
        assert read_pages(s, ks, PAGE) == (4, ps)
        s.put(keys(6, "churn"), pages(6))
        assert s.contains(ks[2:]) == 2  # still pinned after the restart


# What each kind of damage to the middle page of three (one segment) leaves readable.
DAMAGE = {
    "payload": 1,  # a flipped payload byte: that page only
    "header": 1,  # a clobbered magic
    "key": 1,  # a flipped key byte
    "cut": 1,  # the file cut inside page 1: pages 1 and 2 are gone
    "empty": 0,  # the whole segment emptied
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_record_is_a_miss_and_a_log_line(tmp_path, caplog, kind):
    ks, ps = keys(3, "bad"), pages(3)
    s = DiskStore(path=tmp_path)
    s.put(ks, ps)
    seg, off, size = where(s, ks[1])
    if kind == "payload":
        damage(seg, off + size - 100, bytes([ps[1][-100] ^ 1]))
    elif kind == "header":
        damage(seg, off, b"XXXX")
    elif kind == "key":
        damage(seg, off + HEADER_SIZE + 3, b"?")
    elif kind == "cut":
        damage(seg, 0, cut=off + size // 2)
    else:
        damage(seg, 0, cut=0)
    with caplog.at_level(logging.WARNING, logger="pdsdk.stores"):
        hits, got = read_pages(s, ks, PAGE)
    ok = DAMAGE[kind]
    assert (hits, got) == (ok, ps[:ok])  # never the damaged bytes
    assert any(str(seg) in r.getMessage() for r in caplog.records)
    assert s.contains(ks) == ok and s.stats()["errors"] >= 1
    if kind in ("cut", "empty"):
        assert s.contains(ks[2:]) == 0  # past the end: dropped too, not left to fail later
    else:
        assert read_pages(s, ks[2:], PAGE) == (1, ps[2:])
    assert s.put(ks, ps) == 3  # stored again
    assert read_pages(s, ks, PAGE) == (3, ps)
    s.close()
    with DiskStore(path=tmp_path) as s:  # and found again after a restart
        assert read_pages(s, ks, PAGE) == (3, ps)


BIG = (64 << 10) + 100  # checked by block sums (disk_record.checksum), with a tail past the last 4 KiB block


@pytest.mark.parametrize("kind", ["flip", "swap blocks", "zero a block", "tail", "three words"])
def test_large_page_damage_is_caught(tmp_path, caplog, kind):
    ks, ps = keys(2, "big"), pages(2, BIG)
    s = DiskStore(path=tmp_path)
    s.put(ks, ps)
    seg, off, size = where(s, ks[1])
    start = off + size - BIG  # the payload
    page = bytearray(ps[1])
    if kind == "flip":
        page[5000] ^= 0x80
    elif kind == "swap blocks":
        page[4096:8192], page[8192:12288] = page[8192:12288], page[4096:8192]
    elif kind == "zero a block":
        page[12288:16384] = bytes(4096)
    elif kind == "tail":
        page[-1] ^= 1
    else:  # three words, two in one block and two at one word position: all the sums must see
        words = np.frombuffer(bytes(page[:8192]), "<u8").copy()
        words[[0, 1, 512]] ^= np.uint64(1)
        page[:8192] = words.tobytes()
    damage(seg, start, bytes(page))
    with caplog.at_level(logging.WARNING, logger="pdsdk.stores"):
        assert read_pages(s, ks, BIG) == (1, ps[:1])
    assert any("checksum" in r.getMessage() for r in caplog.records)
    s.close()


def test_block_sums_see_every_single_bit_flip_and_block_move():
    page = bytearray(os.urandom(BIG))
    base = _checksum(memoryview(page))
    rng = np.random.default_rng(0)
    for bit in rng.choice(len(page) * 8, 300, replace=False):
        page[bit // 8] ^= 1 << (bit % 8)
        assert _checksum(memoryview(page)) != base
        page[bit // 8] ^= 1 << (bit % 8)
    assert _checksum(memoryview(page)) == base
    blocks = [page[i:i + 4096] for i in range(0, 16 * 4096, 4096)]
    moved = b"".join(blocks[1:] + blocks[:1]) + page[16 * 4096:]
    assert _checksum(memoryview(moved)) != base
    assert _checksum(memoryview(bytes(BIG))) != _checksum(memoryview(bytes(BIG - 8)))
    # A numpy page of another dtype is checked as its bytes.
    arr = np.frombuffer(bytes(page), np.float16)
    assert _checksum(memoryview(arr)) == base
    # What the sums do not see (documented): four words whose changes cancel in both their
    # blocks and their word positions.
    words = np.zeros(BIG // 8, "<u8")
    words[[1, 512]] = 1
    before = _checksum(memoryview(words.tobytes()))
    words[[0, 1, 512, 513]] ^= np.uint64(1)  # +1 -1 in block 0, -1 +1 in block 1
    assert _checksum(memoryview(words.tobytes())) == before


def test_payload_damage_found_after_reopen(tmp_path, caplog):
    """The scan on open reads headers only; the payload is checked when read."""
    ks, ps = keys(3, "later"), pages(3)
    with DiskStore(path=tmp_path) as s:
        s.put(ks, ps)
        seg, off, size = where(s, ks[2])
    damage(seg, off + size - 1, bytes([ps[2][-1] ^ 0x80]))
    with DiskStore(path=tmp_path) as s:
        assert s.contains(ks) == 3
        with caplog.at_level(logging.WARNING, logger="pdsdk.stores"):
            assert read_pages(s, ks, PAGE) == (2, ps[:2])
        assert any("checksum" in r.getMessage() for r in caplog.records)
        assert s.contains(ks) == 2


@pytest.mark.parametrize("torn", ["half a record", "half a header", "zeros"])
def test_torn_tail_after_a_crash_is_cut_on_reopen(tmp_path, caplog, torn):
    """A crash mid-append leaves the start of a record (or zeros: blocks allocated, data not
    written). The reopened store keeps the records before it and appends after them."""
    ks, ps = keys(4, "torn"), pages(4)
    with DiskStore(path=tmp_path) as s:
        s.put(ks[:3], ps[:3])
        seg, off, size = where(s, ks[2])
        s.put(ks[3:], ps[3:])
        whole = seg.read_bytes()
    end = off + size
    record = whole[end:]  # page 3's record, as written
    tail = {"half a record": record[: len(record) // 2], "half a header": record[:HEADER_SIZE // 2],
            "zeros": bytes(len(record))}[torn]
    seg.write_bytes(whole[:end] + tail)
    with caplog.at_level(logging.WARNING, logger="pdsdk.stores"), DiskStore(path=tmp_path) as s:
        assert any("torn or damaged" in r.getMessage() for r in caplog.records)
        assert seg.stat().st_size == end  # the tail is cut off
        assert read_pages(s, ks, PAGE) == (3, ps[:3])
        assert s.stats()["disk_bytes"] == end
        more, more_pages = keys(3, "after"), pages(3)
        assert s.put(ks[3:] + more, ps[3:] + more_pages) == 4
    with DiskStore(path=tmp_path) as s:
        assert read_pages(s, ks + more, PAGE) == (7, ps + more_pages)


def test_delete_and_eviction_stay_gone_after_reopen(tmp_path):
    ks, ps = keys(6, "gone"), pages(6)
    cap = 4 * RECORD
    with DiskStore(path=tmp_path, capacity_bytes=cap, segment_bytes=2 * RECORD) as s:
        s.put(ks[:4], ps[:4])
        assert s.delete(ks[:1]) == 1
        s.put(ks[4:], ps[4:])  # evicts page 1 (LRU): its segment has page 0 (deleted) too
        present = [k for k in ks if s.contains([k])]
        assert present == ks[2:]
        assert s.stats()["disk_bytes"] <= cap
    with DiskStore(path=tmp_path, capacity_bytes=cap) as s:
        assert [k for k in ks if s.contains([k])] == present
        assert read_pages(s, ks[2:], PAGE) == (4, ps[2:])


def test_compaction_keeps_pinned_pages_within_capacity_across_reopen(tmp_path):
    """Every segment holds a pinned page, so no segment ever empties: room comes only from
    compaction (live records moved out, the segment unlinked)."""
    cap, seg_bytes = 16 * RECORD, 4 * RECORD
    pinned, pinned_pages = keys(4, "pin"), pages(4)
    s = DiskStore(path=tmp_path, capacity_bytes=cap, segment_bytes=seg_bytes)
    churn, churn_pages = keys(60, "churn"), pages(60)
    for i in range(4):  # a pinned page, then three others, per segment
        s.put(pinned[i:i + 1], pinned_pages[i:i + 1], Hints(pin=True))
        s.put(churn[3 * i:3 * i + 3], churn_pages[3 * i:3 * i + 3])
    assert s.stats()["segments"] == 4 and s.stats()["disk_bytes"] == cap
    for i in range(12, 60, 2):
        assert s.put(churn[i:i + 2], churn_pages[i:i + 2]) == 2
        stats = s.stats()
        assert stats["disk_bytes"] <= cap and stats["used_bytes"] <= stats["disk_bytes"]
    assert read_pages(s, pinned, PAGE) == (4, pinned_pages)
    assert read_pages(s, churn[-2:], PAGE) == (2, churn_pages[-2:])  # the newest pages
    assert s.stats()["evictions"] >= 44
    before = {k for k in pinned + churn if s.contains([k])}
    assert 12 <= len(before) == s.stats()["pages"]
    assert "00000000.seg" not in {p.name for p in segments(tmp_path)}  # the first segment was compacted
    s.close()
    with DiskStore(path=tmp_path, capacity_bytes=cap, segment_bytes=seg_bytes) as s:
        assert {k for k in pinned + churn if s.contains([k])} == before  # nothing evicted came back
        assert s.stats()["disk_bytes"] <= cap
        for k, p in zip(pinned + churn, pinned_pages + churn_pages):
            if k in before:
                assert read_pages(s, [k], PAGE) == (1, [p])


def test_dead_space_counts_against_capacity(tmp_path):
    cap = 8 * RECORD
    ks, ps = keys(8, "dead"), pages(8)
    with DiskStore(path=tmp_path, capacity_bytes=cap, segment_bytes=cap) as s:
        s.put(ks, ps)
        s.delete(ks[::2])  # half the records dead, in the open segment
        assert s.stats()["disk_bytes"] == cap and s.stats()["used_bytes"] == cap // 2
        more, more_pages = keys(4, "more"), pages(4)
        assert s.put(more, more_pages) == 4  # fits once the dead records are compacted away
        assert s.stats()["disk_bytes"] == cap
        assert read_pages(s, ks[1::2] + more, PAGE) == (8, ps[1::2] + more_pages)


def test_copy_left_by_a_crash_is_indexed_once(tmp_path):
    """A segment's records found twice (a lost dead mark): the newest copy wins, and deleting it
    does not bring the older one back."""
    ks, ps = keys(2, "dup"), pages(2)
    with DiskStore(path=tmp_path) as s:
        s.put(ks, ps)
    first = segments(tmp_path)[0]
    shutil.copy(first, tmp_path / "00000009.seg")
    with DiskStore(path=tmp_path) as s:
        assert read_pages(s, ks, PAGE) == (2, ps) and s.stats()["pages"] == 2
        assert s.delete(ks[:1]) == 1
    with DiskStore(path=tmp_path) as s:
        assert s.contains(ks[:1]) == 0 and s.contains(ks[1:]) == 1


def test_demoted_pages_keep_their_bytes(tmp_path):
    demoted = {}
    s = DiskStore(path=tmp_path, capacity_bytes=4 * RECORD, segment_bytes=2 * RECORD)
    s.set_demote(lambda key, page, hints: demoted.__setitem__(key, (bytes(page), hints.priority)))
    ks, ps = keys(8, "demote"), pages(8)
    for i in range(8):
        s.put(ks[i:i + 1], ps[i:i + 1], Hints(priority=i))
    assert demoted and all(demoted[k] == (p, i) for i, (k, p) in enumerate(zip(ks, ps)) if k in demoted)
    assert len(demoted) + s.stats()["pages"] == 8
    s.close()


def test_old_file_per_page_layout_is_removed(tmp_path):
    old = tmp_path / "ab" / ("ab" + "0" * 38 + ".kv")
    old.parent.mkdir()
    old.write_bytes(b"x" * 100)
    (tmp_path / ".tmp").mkdir()
    with DiskStore(path=tmp_path) as s:
        assert not old.exists() and not old.parent.exists() and not (tmp_path / ".tmp").exists()
        assert s.put(keys(1, "new"), pages(1)) == 1


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs: a real filesystem that fills up. Mounting needs root."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                       check=False, capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("batch", [1, 4])
def test_full_filesystem_evicts_and_never_raises(tiny_fs, batch):
    s = DiskStore(path=tiny_fs, capacity_bytes=64 << 20)  # our bound is far above the filesystem's
    ks, ps = keys(80, "full"), pages(80, 64 << 10)  # 5 MiB into 1 MiB
    for i in range(0, 80, batch):
        s.put(ks[i:i + batch], ps[i:i + batch])
    stats = s.stats()
    assert stats["errors"] >= 1 or stats["evictions"] >= 1
    survivors = [i for i, k in enumerate(ks) if s.contains([k])]
    assert survivors and survivors[-1] == 79  # making room kept the newest page
    for i in survivors:
        assert read_pages(s, [ks[i]], 64 << 10) == (1, [ps[i]])
    s.close()
    with DiskStore(path=tiny_fs, capacity_bytes=64 << 20) as s:  # what it kept is found again
        assert [i for i, k in enumerate(ks) if s.contains([k])] == survivors
