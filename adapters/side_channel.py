"""The side channel through which a decode worker fetches a prefill worker's transport descriptor.

The prefill engine serves one small ZeroMQ endpoint; its address travels in `kv_transfer_params`.
A decode worker asks once per (engine, TP rank) and caches the connection. msgpack both ways.

Every request is hostile until validated: frames over MAX_REQUEST bytes make ZeroMQ drop the peer
(ZMQ_MAXMSGSIZE), a request must decode as `Ask`, errors never echo what was sent, and no message
can end the serving thread. With a shared secret (`side_channel_secret` in the adapter's config, or
PDSDK_SIDE_CHANNEL_SECRET), a request carries an HMAC-SHA256 of its rank and a fresh nonce, and the
reply a second frame: the HMAC of that nonce and the reply, so neither side takes the other's word
without it. The secret itself never crosses the wire.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from typing import Annotated, Any

import msgspec
import zmq

from pdsdk.adapters.common.refusals import Refusals

log = logging.getLogger(__name__)

SECRET_KEY = "side_channel_secret"
SECRET_ENV = "PDSDK_SIDE_CHANNEL_SECRET"
MAX_REQUEST = 1024  # bytes per frame a server reads; a request takes under 100
MAX_REPLY = 64 << 20  # bytes per frame a client reads: descriptors of many regions


class Ask(msgspec.Struct, forbid_unknown_fields=True):
    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    nonce: Annotated[bytes, msgspec.Meta(max_length=64)] = b""  # with a secret: fresh random bytes
    mac: Annotated[bytes, msgspec.Meta(max_length=64)] = b""  # with a secret: _mac(secret, b"ask", rank, nonce)


class Entry(msgspec.Struct):
    """What a prefill worker serves: its transport descriptor and KV geometry."""

    descriptor: bytes
    geometry: list[list[int]]
    heads: list[list[int]] | None
    tp_rank: int
    engine_id: str


class Reply(msgspec.Struct, omit_defaults=True):
    entry: Entry | None = None
    error: str | None = None


_ask = msgspec.msgpack.Decoder(Ask)
_reply = msgspec.msgpack.Decoder(Reply)
MALFORMED = Reply(error="malformed request: expected msgpack {tp_rank: int >= 0, nonce: bytes, mac: bytes}")
UNAUTHORIZED = Reply(error=f"unauthorized: the request's MAC does not match this prefill's {SECRET_KEY}")


def secret_from(configured: str | None) -> bytes | None:
    """The shared secret: the configured one, else PDSDK_SIDE_CHANNEL_SECRET; None for none."""
    value = configured or os.environ.get(SECRET_ENV)
    return str(value).encode() if value else None


def _mac(secret: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(4, "little") + part)
    return h.digest()


def _rank_bytes(rank: int) -> bytes:
    return rank.to_bytes(4, "little")


class SideChannelServer:
    """Answers an `Ask` for rank r with `entries[r]` (set once the workers are up)."""

    def __init__(self, host: str, port: int = 0, secret: bytes | None = None):
        self.entries: dict[int, Entry] = {}
        self.secret = secret
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST)
        self.host = host
        self.port = self._sock.bind_to_random_port(f"tcp://{host}") if port == 0 else port
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        self._refuse = Refusals(f"side channel {host}:{self.port}", log)  # answered with an error or dropped
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pdsdk-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(100):
                    self._answer(self._sock.recv_multipart(zmq.NOBLOCK))
            except Exception as e:  # noqa: BLE001 - no message may end this thread
                if not self._stop.is_set():
                    self._refuse(f"{type(e).__name__} while answering")

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1]:  # a REQ socket's request: [identity, empty, body]
            return self._refuse(f"{len(frames)} frames, not a request")
        ident, _, body = frames
        try:
            ask = _ask.decode(body)
        except (msgspec.DecodeError, RecursionError):  # ValidationError is a DecodeError
            self._refuse("a malformed request")
            return self._send(ident, MALFORMED)
        if self.secret is not None and not hmac.compare_digest(
                ask.mac, _mac(self.secret, b"ask", _rank_bytes(ask.tp_rank), ask.nonce)):
            self._refuse("a request without the shared secret's MAC")
            return self._send(ident, UNAUTHORIZED)
        entry = self.entries.get(ask.tp_rank)
        reply = Reply(entry=entry) if entry is not None else Reply(
            error=f"no worker of TP rank {ask.tp_rank} has registered here (known: {sorted(self.entries)})")
        self._send(ident, reply, ask.nonce)

    def _send(self, ident: bytes, reply: Reply, nonce: bytes | None = None) -> None:
        body = msgspec.msgpack.encode(reply)
        frames = [ident, b"", body]
        if self.secret is not None and nonce is not None:
            frames.append(_mac(self.secret, b"reply", nonce, body))
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # the peer is gone or not reading: its loss
            pass

    @property
    def refused(self) -> int:
        return self._refuse.count

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)


def fetch(host: str, port: int, tp_rank: int, timeout_s: float, secret: bytes | None = None) -> dict[str, Any]:
    """The entry a prefill engine serves for `tp_rank`, as a dict; ConnectionError within `timeout_s`."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    where = f"prefill side channel {host}:{port}"
    ask = Ask(tp_rank=tp_rank)
    if secret is not None:
        nonce = os.urandom(16)
        ask = Ask(tp_rank=tp_rank, nonce=nonce, mac=_mac(secret, b"ask", _rank_bytes(tp_rank), nonce))
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msgspec.msgpack.encode(ask))
        frames = sock.recv_multipart()
    except zmq.Again:
        raise ConnectionError(f"{where} did not answer within {timeout_s:g}s") from None
    finally:
        sock.close(0)
    try:
        reply = _reply.decode(frames[0])
    except msgspec.DecodeError as e:
        raise ConnectionError(f"{where} sent a malformed reply: {e}") from None
    if reply.error is not None:
        raise ConnectionError(f"{where}: {reply.error[:500]}")
    if secret is not None and (len(frames) != 2 or not hmac.compare_digest(
            frames[1], _mac(secret, b"reply", ask.nonce, frames[0]))):
        raise ConnectionError(f"{where}: the reply is not signed with this worker's {SECRET_KEY}")
    if reply.entry is None:
        raise ConnectionError(f"{where} sent neither an entry nor an error")
    return msgspec.structs.asdict(reply.entry)
