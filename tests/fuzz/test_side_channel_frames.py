"""Fuzz: frames against a real side-channel server on loopback. Each request gets a short error or
the entry, or is dropped; the serving thread lives; a real fetch still gets the exact entry."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdsdk.adapters.side_channel import MAX_REQUEST, Entry, SideChannelServer, fetch

ENTRY = Entry(descriptor=b"\x01\x02", geometry=[[1, 2, 3, 4]], heads=[[1, 1, 1, 1]], tp_rank=0, engine_id="p")
VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(), st.text(max_size=30),
              st.binary(max_size=30)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20)
ASKS = st.one_of(VALUES, st.fixed_dictionaries({"tp_rank": VALUES}, optional={
    "nonce": VALUES, "mac": VALUES, "x": VALUES}))
BODIES = st.one_of(st.binary(max_size=2 * MAX_REQUEST), ASKS.map(msgspec.msgpack.encode),
                   st.integers(1, 5000).map(lambda n: b"\x81\xa7tp_rank" + b"\x91" * n + b"\x00"))
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def server():
    s = SideChannelServer("127.0.0.1")
    s.entries[0] = ENTRY
    yield s
    assert s.alive
    s.close()


@pytest.fixture(scope="module")
def ctx():
    return zmq.Context.instance()


def _serves(server) -> None:
    assert server.alive
    assert fetch("127.0.0.1", server.port, 0, 2.0) == msgspec.structs.asdict(ENTRY)


@FUZZ
@given(body=BODIES)
def test_request_bodies(server, ctx, body):
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 200 if len(body) > MAX_REQUEST else 2000)
    try:
        sock.connect(f"tcp://127.0.0.1:{server.port}")
        sock.send(body)
        try:
            reply = msgspec.msgpack.decode(sock.recv())
        except zmq.Again:
            reply = None
    finally:
        sock.close(0)
    if len(body) <= MAX_REQUEST:
        assert reply is not None  # every request within the cap is answered
    if reply is not None:
        assert set(reply) in ({"entry"}, {"error"})
        if "error" in reply:
            assert len(reply["error"]) < 200
    _serves(server)


@FUZZ
@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=8))
def test_raw_multipart(server, ctx, frames):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    sock.send_multipart(frames)
    sock.close(0)
    _serves(server)


@pytest.mark.slow
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES)
def test_request_bodies_long(server, ctx, body):
    test_request_bodies.hypothesis.inner_test(server, ctx, body)
