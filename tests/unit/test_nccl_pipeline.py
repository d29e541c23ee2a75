"""The `nccl` transport's pipelined scattered path: chunks of a transfer, each its own send/recv,
packed on one side and unpacked on the other while the next chunk moves (gloo, between processes).

The conformance suite moves at most a few MiB, one chunk at the default `chunk_mb`; here chunks are
64 KiB so every scattered transfer is dozens of them."""

from __future__ import annotations

import base64
import itertools
import time

import numpy as np
import pytest
from helpers import need_plugin, span_digest as digest

from pdsdk.kv import KVLayout, Span, coalesce, page_spans
from pdsdk.plugins import registry

LAYOUT = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 64, "page_size": 32}  # 4 KiB pages
PAGE = 4096
NBYTES = 8 << 20
DEADLINE_S = 5.0
OPTIONS = {"chunk_mb": 1 / 16}


def _spec():
    spec = registry().get("transport", "nccl")
    need_plugin(spec)
    return spec


def make_transport(**options):
    from pdsdk.connectors.transports.common.buffers import allocate

    t = _spec().load()(name="nccl", layout=KVLayout(**LAYOUT), transfer_timeout_s=DEADLINE_S, **options)
    buf, region = allocate(NBYTES)
    t.register([region])
    return t, buf


@pytest.fixture(scope="module")
def pair():
    from pdsdk.testing.peer import PeerProcess

    t, buf = make_transport(**OPTIONS)
    peer = PeerProcess("nccl", NBYTES, layout=LAYOUT, options=OPTIONS, timeout=DEADLINE_S)
    remote = t.connect(peer.descriptor)
    yield t, buf, peer, remote
    peer.close()
    t.close()



def test_chunk_bounds_cut_rows_into_chunks_of_about_chunk_bytes():
    _spec()
    from pdsdk.connectors.transports.nccl.pairs import chunk_bounds

    spans = page_spans(0, np.random.default_rng(1).permutation(1000)[:300], PAGE)
    bounds = chunk_bounds(spans, 64 << 10)
    assert bounds[0] == 0 and bounds[-1] == len(spans) and bounds == sorted(set(bounds))
    sizes = [int(spans[a:b, 2].sum()) for a, b in itertools.pairwise(bounds)]
    assert max(sizes) <= 64 << 10 and sum(sizes) == 300 * PAGE and len(sizes) >= 300 * PAGE // (64 << 10)
    assert chunk_bounds(spans, 0) == [0, len(spans)]  # chunking off: one chunk
    assert chunk_bounds(spans[:1], 1024) == [0, 1]  # one run
    long_row = np.array([[0, 0, 1 << 20], [0, 2 << 20, PAGE]])
    assert chunk_bounds(long_row, 64 << 10) == [0, 1, 2]  # a row longer than a chunk is a chunk of its own


@pytest.mark.parametrize("op", ["read", "write"])
def test_chunked_scattered_transfer_is_bit_exact(pair, op):
    t, buf, peer, remote = pair
    rng = np.random.default_rng(31 if op == "read" else 32)
    run_pages = (1 << 20) // PAGE
    local_ids = rng.permutation(NBYTES // PAGE - run_pages)[:500]  # clear of the local run at the end
    remote_ids = run_pages + rng.permutation(NBYTES // PAGE - run_pages)[:500]  # clear of the remote run
    # Plus one 1 MiB run: longer than a chunk on both sides, so it is cut into chunk-sized pieces.
    local = np.concatenate((page_spans(0, local_ids, PAGE), [[0, NBYTES - (1 << 20), 1 << 20]]))
    rem = np.concatenate((page_spans(0, remote_ids, PAGE), [[0, 0, 1 << 20]]))
    local, rem = coalesce(local, rem)
    peer.call("fill", seed=33)
    buf[:] = rng.integers(0, 256, NBYTES, dtype=np.uint8)
    post = t.read if op == "read" else t.write
    time.sleep(0.2)
    peer.call("notifications")  # drop earlier tests' notifications
    assert t.wait(post(remote, local, rem, notify=b"chunked")).state == "done"
    assert digest(buf, local) == peer.call("digest", spans=rem.tolist())["digest"]
    if op == "write":  # the peer queues the notify before its ack, once every chunk has landed
        got = peer.call("notifications")["notifications"]
        assert [(a, base64.b64decode(m)) for a, m in got] == [(t.agent, b"chunked")]


def test_chunked_transfers_in_flight_together(pair):
    """Each transfer takes its own block of tags: concurrent chunked transfers do not cross."""
    t, buf, peer, remote = pair
    rng = np.random.default_rng(41)
    peer.call("fill", seed=42)
    buf[:] = 0
    quarter = NBYTES // PAGE // 4
    jobs = []
    for i in range(4):
        local_ids = i * quarter + rng.permutation(quarter)[:200]
        remote_ids = rng.permutation(NBYTES // PAGE)[:200]
        local, rem = page_spans(0, local_ids, PAGE), page_spans(0, remote_ids, PAGE)
        jobs.append((t.read(remote, local, rem), local, rem))
    assert [t.wait(h).state for h, _, _ in jobs] == ["done"] * 4
    for _, local, rem in jobs:
        assert digest(buf, local) == peer.call("digest", spans=rem.tolist())["digest"]


def test_peer_killed_mid_chunked_transfer_fails_within_the_deadline():
    from pdsdk.testing.peer import PeerProcess

    options = {"chunk_mb": 1 / 64}  # 16 KiB: hundreds of chunks in flight when the peer dies
    t, _buf = make_transport(**options)  # _buf owns the registered memory: keep it
    peer = PeerProcess("nccl", NBYTES, layout=LAYOUT, options=options, timeout=DEADLINE_S)
    try:
        remote = t.connect(peer.descriptor)
        rng = np.random.default_rng(51)
        spans = [(page_spans(0, rng.permutation(NBYTES // PAGE), PAGE),
                  page_spans(0, rng.permutation(NBYTES // PAGE), PAGE)) for _ in range(3)]
        assert t.wait(t.read(remote, *spans[0])).state == "done"
        handles = [t.read(remote, *s) for s in spans] + [t.write(remote, *s) for s in spans]
        peer.kill()
        handles.append(t.read(remote, *spans[0]))
        start = time.monotonic()
        states = [t.wait(h, timeout=DEADLINE_S + 5) for h in handles]
        assert time.monotonic() - start < DEADLINE_S + 5
        assert all(s.final for s in states), states  # done before the kill, or failed: none hangs
        assert states[-1].state == "failed" and states[-1].reason
        assert t.wait(t.read(remote, [Span(0, 0, PAGE)], [Span(0, 0, PAGE)])).state == "failed"
    finally:
        peer.close()
        t.close()
