"""The prefill side channel under hostile messages: it answers or drops each one, never echoes
what was sent, never dies, and keeps serving real fetches; the shared secret keeps strangers out."""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from pdsdk.adapters.side_channel import MAX_REQUEST, SECRET_ENV, Entry, SideChannelServer, fetch, secret_from

ENTRY = Entry(descriptor=b"\x00descriptor", geometry=[[2, 1, 2, 3]], heads=None, tp_rank=0, engine_id="prefill-0")


@pytest.fixture
def server():
    s = SideChannelServer("127.0.0.1")
    s.entries[0] = ENTRY
    yield s
    s.close()


def ask(port, body: bytes, timeout_ms=1000) -> bytes | None:
    """Send one REQ message; its reply, or None when none came (dropped)."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(body)
        return sock.recv()
    except zmq.Again:
        return None
    finally:
        sock.close(0)


def still_serves(server) -> None:
    assert server.alive
    assert fetch("127.0.0.1", server.port, 0, 2.0) == msgspec.structs.asdict(ENTRY)


NESTED = b"\x81\xa7tp_rank" + b"\x91" * 900 + b"\x00"  # {"tp_rank": [[[...[0]...]]]}, under the size cap


@pytest.mark.parametrize("body", [
    msgspec.msgpack.encode({"tp_rank": [0]}),  # unhashable: ended the thread
    NESTED,
    msgspec.msgpack.encode({"tp_rank": "x" * 900}),
    msgspec.msgpack.encode({"tp_rank": -1}),
    msgspec.msgpack.encode({"tp_rank": 1 << 40}),
    msgspec.msgpack.encode({"tp_rank": 0, "extra": 1}),
    msgspec.msgpack.encode([0]),
    b"\xc1",  # never used in msgpack
    b"",
])
def test_malformed_requests_get_a_short_error_and_the_thread_lives(server, body):
    reply = msgspec.msgpack.decode(ask(server.port, body))
    assert reply["error"].startswith("malformed request") and len(reply["error"]) < 200
    assert b"xxxx" not in msgspec.msgpack.encode(reply)  # nothing of the request comes back
    still_serves(server)
    assert server.refused == 1


@pytest.mark.parametrize("body", [
    b"\x81\xa7tp_rank" + b"\x91" * 100_000 + b"\x00",  # 100 KB of nesting: a RecursionError
    msgspec.msgpack.encode({"tp_rank": "x" * (1 << 20)}),  # 1 MiB that must not be echoed back
])
def test_oversized_requests_are_dropped_unread(server, body):
    assert len(body) > MAX_REQUEST
    assert ask(server.port, body, timeout_ms=300) is None
    still_serves(server)


def test_unknown_rank_is_named_without_echo(server):
    reply = msgspec.msgpack.decode(ask(server.port, msgspec.msgpack.encode({"tp_rank": 7})))
    assert reply == {"error": "no worker of TP rank 7 has registered here (known: [0])"}


def test_frames_that_are_not_requests_are_dropped(server):
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        for frames in ([b"x"], [b"", b"a", b"b", b"c"], [b"not empty", b"body"], [b""] * 1000):
            dealer.send_multipart(frames)
        deadline = time.monotonic() + 10
        while server.refused < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        dealer.close(0)  # only now: closing with LINGER 0 drops frames not yet on the wire
    assert server.refused == 4
    still_serves(server)


def test_a_512_mib_frame_does_not_grow_the_server(tmp_path):
    """A real server in its own process: ZMQ_MAXMSGSIZE drops the sender after the frame header."""
    code = ("import sys; from pdsdk.adapters.side_channel import SideChannelServer, Entry\n"
            "s = SideChannelServer('127.0.0.1'); s.entries[0] = Entry(b'd', [], None, 0, 'e')\n"
            "print(s.port, flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path)  # not the tree: the installed pdsdk
    try:
        port = int(proc.stdout.readline())
        before = _peak_rss_mb(proc.pid)
        sender = zmq.Context.instance().socket(zmq.DEALER)
        sender.setsockopt(zmq.LINGER, 0)
        sender.connect(f"tcp://127.0.0.1:{port}")
        sender.send_multipart([b"", bytes(512 << 20)], copy=False)
        time.sleep(1.0)
        sender.close(0)
        assert _peak_rss_mb(proc.pid) - before < 32
        assert fetch("127.0.0.1", port, 0, 2.0)["descriptor"] == b"d"
    finally:
        proc.stdin.close()
        proc.wait(10)


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def test_shared_secret(monkeypatch):
    secret = b"s3cret"
    s = SideChannelServer("127.0.0.1", secret=secret)
    s.entries[0] = ENTRY
    try:
        assert fetch("127.0.0.1", s.port, 0, 2.0, secret=secret)["engine_id"] == "prefill-0"
        for wrong in (None, b"other"):
            with pytest.raises(ConnectionError, match="unauthorized"):
                fetch("127.0.0.1", s.port, 0, 2.0, secret=wrong)
        assert s.alive
    finally:
        s.close()
    plain = SideChannelServer("127.0.0.1")  # no secret: its replies are not signed
    plain.entries[0] = ENTRY
    try:
        with pytest.raises(ConnectionError, match="not signed"):
            fetch("127.0.0.1", plain.port, 0, 2.0, secret=secret)
    finally:
        plain.close()
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert secret_from(None) == b"from-env" and secret_from("configured") == b"configured"
    monkeypatch.delenv(SECRET_ENV)
    assert secret_from(None) is None and secret_from("") is None
