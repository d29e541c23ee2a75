"""The L2 transport contract, run against every registered transport, between real processes.

The other side of each transfer is the same transport in its own interpreter (`start_peer`), or, for
a transport whose peers live in one process (`IN_PROCESS`, e.g. `fake`), in this one.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from helpers import need_plugin, span_digest as digest
from pdsdk.connectors.transports.common.buffers import allocate
from pdsdk.testing.peer import start_peer

import pdsdk
from pdsdk import LayoutMismatch, TransportError, open_transport
from pdsdk.kv import KVLayout, Span, page_spans
from pdsdk.plugins import plugin_manager, registry

LAYOUT = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 64, "page_size": 32}  # 4 KiB pages
PAGE = 4096
NBYTES = 8 << 20
DEADLINE_S = 5.0


def make_transport(name: str, layout: dict | None = None, **options):
    need_plugin(registry().get("transport", name))
    t = open_transport(name, layout=KVLayout(**(layout or LAYOUT)), transfer_timeout_s=DEADLINE_S, **options)
    buf, region = allocate(NBYTES)
    t.register([region])
    return t, buf


@pytest.fixture(scope="module")
def pair(transport_name):
    """(local transport, its buffer, peer process, connected peer); shared by a module's tests."""
    t, buf = make_transport(transport_name)
    peer = start_peer(transport_name, NBYTES, layout=LAYOUT, timeout=DEADLINE_S)
    remote = t.connect(peer.descriptor)
    yield t, buf, peer, remote
    peer.close()
    t.close()



def rows(spans) -> list[list[int]]:
    return np.asarray(spans).tolist()


def test_an_idle_transport_leaves_the_cpu_alone(pair):
    """Connected and idle, a transport's threads sleep: a busy-polling progress thread takes a core
    from the engine it serves (NIXL's Python agent polls with no delay unless told otherwise)."""
    t, buf, peer, remote = pair
    assert t.wait(t.read(remote, [Span(0, 0, PAGE)], [Span(0, 0, PAGE)])).state == "done"
    cpu, wall = time.process_time(), time.monotonic()
    time.sleep(1.0)
    share = (time.process_time() - cpu) / (time.monotonic() - wall)
    assert share < 0.2, f"{t.name} used {share:.0%} of a core while idle"


def test_read_and_write_random_bytes(pair):
    t, buf, peer, remote = pair
    peer.call("fill", seed=11)
    assert t.wait(t.read(remote, [Span(0, 0, NBYTES)], [Span(0, 0, NBYTES)])).state == "done"
    assert digest(buf, [[0, 0, NBYTES]]) == peer.call("digest", spans=[[0, 0, NBYTES]])["digest"]

    buf[:] = np.random.default_rng(12).integers(0, 256, NBYTES, dtype=np.uint8)
    half = NBYTES // 2
    assert t.wait(t.write(remote, [Span(0, 0, half)], [Span(0, half, half)])).state == "done"
    assert digest(buf, [[0, 0, half]]) == peer.call("digest", spans=[[0, half, half]])["digest"]


@pytest.mark.parametrize("op", ["read", "write"])
def test_scattered_pages_out_of_order(pair, op):
    t, buf, peer, remote = pair
    rng = np.random.default_rng(13)
    pages = NBYTES // PAGE
    local_ids, remote_ids = rng.permutation(pages)[:400], rng.permutation(pages)[:400]
    local, rem = page_spans(0, local_ids, PAGE), page_spans(0, remote_ids, PAGE)
    peer.call("fill", seed=14)
    buf[:] = rng.integers(0, 256, NBYTES, dtype=np.uint8)
    handle = (t.read if op == "read" else t.write)(remote, local, rem)
    assert t.wait(handle).state == "done"
    assert digest(buf, local) == peer.call("digest", spans=rows(rem))["digest"]


@pytest.mark.parametrize("op", ["read", "write"])
def test_page_api_moves_scattered_pages(pair, op):
    t, buf, peer, remote = pair
    rng = np.random.default_rng(16)
    local_ids, remote_ids = rng.permutation(NBYTES // PAGE)[:300], rng.permutation(NBYTES // PAGE)[:300]
    peer.call("fill", seed=17)
    buf[:] = rng.integers(0, 256, NBYTES, dtype=np.uint8)
    post = t.read_pages if op == "read" else t.write_pages
    assert t.wait(post(remote, 0, local_ids, 0, remote_ids)).state == "done"
    assert digest(buf, page_spans(0, local_ids, PAGE)) == \
        peer.call("digest", spans=rows(page_spans(0, remote_ids, PAGE)))["digest"]
    with pytest.raises(ValueError, match=r"remote page ids must be in \[0, 2048\)"):
        t.read_pages(remote, 0, [0], 0, [NBYTES // PAGE])
    with pytest.raises(ValueError, match="2 local pages but 1 remote"):
        t.read_pages(remote, 0, [0, 1], 0, [0])


def test_many_transfers_in_flight(pair):
    t, buf, peer, remote = pair
    peer.call("fill", seed=15)
    buf[:] = 0
    chunk = NBYTES // 16
    handles = [t.read(remote, [Span(0, i * chunk, chunk)], [Span(0, (15 - i) * chunk, chunk)]) for i in range(16)]
    assert [t.wait(h).state for h in handles] == ["done"] * 16
    for i in range(16):
        assert digest(buf, [[0, i * chunk, chunk]]) == \
            peer.call("digest", spans=[[0, (15 - i) * chunk, chunk]])["digest"]


def test_notifications_reach_the_peer(pair):
    t, buf, peer, remote = pair
    t.wait(t.read(remote, [Span(0, 0, PAGE)], [Span(0, 0, PAGE)], notify=b"read-done:42"))
    t.wait(t.write(remote, [Span(0, 0, PAGE)], [Span(0, PAGE, PAGE)], notify=b"write-done:43"))
    import base64

    got: list = []
    end = time.monotonic() + DEADLINE_S
    while len(got) < 2 and time.monotonic() < end:
        got += [(a, base64.b64decode(m)) for a, m in peer.call("notifications")["notifications"]]
        time.sleep(0.05)
    assert sorted(got) == [(t.agent, b"read-done:42"), (t.agent, b"write-done:43")]


def test_bad_spans_are_clear_errors(pair):
    t, buf, peer, remote = pair
    with pytest.raises(ValueError, match="local span 0 has length 0"):
        t.read(remote, [Span(0, 0, 0)], [Span(0, 0, 0)])
    with pytest.raises(ValueError, match=r"local span 1 \[.*\) is outside region 0"):
        t.read(remote, [Span(0, 0, PAGE), Span(0, NBYTES - 10, PAGE)], [Span(0, 0, PAGE), Span(0, PAGE, PAGE)])
    with pytest.raises(ValueError, match="remote span 0 names region 5"):
        t.read(remote, [Span(0, 0, PAGE)], [Span(5, 0, PAGE)])
    with pytest.raises(ValueError, match="local length 4096 != remote length 8192"):
        t.read(remote, [Span(0, 0, PAGE)], [Span(0, 0, 2 * PAGE)])


def test_stats_report_the_path(pair):
    t, *_ = pair
    stats = t.stats()
    assert stats["transport"] == t.name and stats["path"] and stats["transfers"] >= 1
    assert stats["bytes"] > 0 and stats["failed"] == 0


def test_observation_hooks_see_transfers(pair):
    t, buf, peer, remote = pair
    seen = []

    class Recorder:
        @pdsdk.hookimpl
        def pdsdk_transfer_finished(self, transport, transfer_id, peer, nbytes, seconds, path):
            seen.append((transport, nbytes, path))

    recorder = Recorder()
    plugin_manager().register(recorder)
    try:
        t.wait(t.read(remote, [Span(0, 0, 3 * PAGE)], [Span(0, 0, 3 * PAGE)]))
    finally:
        plugin_manager().unregister(recorder)
    assert seen == [(t.name, 3 * PAGE, t.path())]


def test_layout_mismatch_fails_at_connect_naming_the_field(transport_name):
    t, _ = make_transport(transport_name, {**LAYOUT, "page_size": 64})
    peer = start_peer(transport_name, NBYTES, layout=LAYOUT)
    try:
        with pytest.raises(LayoutMismatch, match="page_size: local=64 remote=32"):
            t.connect(peer.descriptor)
    finally:
        peer.close()
        t.close()


def test_wrong_transport_descriptor_is_refused(transport_name):
    other = next((n for n in registry().names("transport") if n != transport_name and
                  registry().get("transport", n).why_not is None), None)
    if other is None:
        pytest.skip("needs a second loadable transport")
    t, _ = make_transport(transport_name)
    o, _ = make_transport(other)
    try:
        with pytest.raises(TransportError, match=f"uses transport '{other}'"):
            t.connect(o.descriptor())
        with pytest.raises(TransportError, match="not a pdsdk descriptor"):
            t.connect(b"\x00garbage")
    finally:
        o.close()
        t.close()


def test_double_close_then_use_is_an_error(transport_name):
    t, _ = make_transport(transport_name)
    t.close()
    t.close()
    with pytest.raises(TransportError, match="is closed"):
        t.descriptor()


def test_peer_killed_mid_transfer_fails_within_the_deadline(transport_name):
    t, buf = make_transport(transport_name)
    peer = start_peer(transport_name, NBYTES, layout=LAYOUT, timeout=DEADLINE_S)
    try:
        remote = t.connect(peer.descriptor)
        assert t.wait(t.read(remote, [Span(0, 0, PAGE)], [Span(0, 0, PAGE)])).state == "done"
        handles = [t.read(remote, [Span(0, 0, NBYTES)], [Span(0, 0, NBYTES)]) for _ in range(4)]
        peer.kill()
        handles += [t.read(remote, [Span(0, 0, NBYTES)], [Span(0, 0, NBYTES)])]
        start = time.monotonic()
        states = [t.wait(h, timeout=DEADLINE_S + 5) for h in handles]
        assert time.monotonic() - start < DEADLINE_S + 5
        assert all(s.final for s in states), states
        assert states[-1].state == "failed" and states[-1].reason
        assert t.stats()["failed"] >= 1
    finally:
        peer.close()
        t.close()


@pytest.mark.parametrize("op", ["read", "write"])
def test_staged_path_moves_scattered_pages(transport_name, op):
    """Gather -> one contiguous transfer -> scatter, forced on (the cost rule picks it on GPUs)."""
    if not registry().load("transport", transport_name).SUPPORTS_STAGING:
        pytest.skip(f"{transport_name} has no staged path (it needs none)")
    options = {"staging": "on", "staging_bytes": 4 << 20}
    t, buf = make_transport(transport_name, **options)
    peer = start_peer(transport_name, NBYTES, layout=LAYOUT, options=options)
    try:
        remote = t.connect(peer.descriptor)
        rng = np.random.default_rng(21)
        local = page_spans(0, rng.permutation(NBYTES // PAGE)[:300], PAGE)
        rem = page_spans(0, rng.permutation(NBYTES // PAGE)[:300], PAGE)
        peer.call("fill", seed=22)
        buf[:] = rng.integers(0, 256, NBYTES, dtype=np.uint8)
        post = t.read if op == "read" else t.write
        assert t.wait(post(remote, local, rem, notify=b"staged")).state == "done"
        assert digest(buf, local) == peer.call("digest", spans=rows(rem))["digest"]
        # twice: staging areas are given back
        assert t.wait(post(remote, local, rem)).state == "done"
        with pytest.raises(ValueError):
            t.read(remote, [Span(0, 0, 0)], [Span(0, 0, 0)])
    finally:
        peer.close()
        t.close()
