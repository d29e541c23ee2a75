"""Fuzz: random damage to a disk store's segment files, made while it is open or closed. Every get
answers the exact bytes that were put or a miss; a deleted page stays deleted under bit flips;
nothing raises; and the store goes on storing and serving pages."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdsdk.connectors.stores.disk.store import DiskStore

KINDS = ("flip", "random bytes", "zeros", "truncate", "garbage tail", "copy")
DAMAGE = st.tuples(st.sampled_from(KINDS), st.integers(0, 7), st.floats(0, 1), st.integers(1, 64))
FUZZ = settings(max_examples=60, deadline=None)


def _damage(path: Path, kind: str, where: float, n: int, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    if not data:
        return
    at = min(int(where * len(data)), len(data) - 1)
    if kind == "flip":
        data[at] ^= 1 << rng.randrange(8)
    elif kind == "random bytes":
        data[at:at + n] = rng.randbytes(len(data[at:at + n]))
    elif kind == "zeros":
        data[at:at + n] = bytes(len(data[at:at + n]))
    elif kind == "truncate":
        del data[at:]
    elif kind == "garbage tail":
        data += rng.randbytes(n)
    else:  # a run of bytes copied from elsewhere in the file (record headers included)
        src = rng.randrange(len(data))
        data[at:at + n] = data[src:src + n][: len(data[at:at + n])]
    path.write_bytes(bytes(data))


def _check(store, pages: dict, deleted: set, strict_deleted: bool) -> None:
    for key, page in pages.items():
        out = bytearray(len(page))
        if store.get([key], [out]):
            assert bytes(out) == page, "wrong bytes"
            assert key not in deleted or not strict_deleted, "a deleted page came back"


@FUZZ
@given(damage=st.lists(DAMAGE, min_size=1, max_size=4), while_open=st.booleans(), seed=st.integers(0, 1 << 16))
def test_segment_damage(damage, while_open, seed):
    rng = random.Random(seed)
    keys = [rng.randbytes(32) for _ in range(16)]
    pages = {k: rng.randbytes(rng.choice([4096, 70_000])) for k in keys}  # CRC-32 and block-sum pages
    deleted = set(keys[::5])
    with tempfile.TemporaryDirectory() as tmp:
        store = DiskStore(path=tmp, segment_bytes=256 << 10)
        try:
            assert store.put(keys, list(pages.values())) == len(keys)
            store.delete(list(deleted))
            if not while_open:
                store.close()
            files = sorted(Path(tmp).glob("*.seg"))
            for kind, pick, where, n in damage:
                _damage(files[pick % len(files)], kind, where, n, rng)
            if not while_open:
                store = DiskStore(path=tmp, segment_bytes=256 << 10)
            only_flips = all(kind == "flip" for kind, *_ in damage)
            _check(store, pages, deleted, only_flips)
            assert store.contains(keys) <= len(keys)
            assert store.put(keys, list(pages.values())) == len(keys)  # stores again over the damage
            _check(store, pages, set(), False)
            assert all(store.get([k], [bytearray(len(p))]) == 1 for k, p in pages.items())
        finally:
            store.close()
        with DiskStore(path=tmp, segment_bytes=256 << 10) as store:  # and finds them after a restart
            assert all(store.get([k], [bytearray(len(p))]) == 1 for k, p in pages.items())
            _check(store, pages, set(), False)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None)
@given(damage=st.lists(DAMAGE, min_size=1, max_size=8), while_open=st.booleans(), seed=st.integers(0, 1 << 30))
def test_segment_damage_long(damage, while_open, seed):
    test_segment_damage.hypothesis.inner_test(damage, while_open, seed)
