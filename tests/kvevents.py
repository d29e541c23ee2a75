"""Shared by the KV event tests (tests/router/test_kv_*.py): block size, engine-shaped events, publishing."""

from __future__ import annotations

from helpers import eventually
from pdsdk.ports import free_port
from pdsdk.router.kvindex.wire import decode_batch
from pdsdk.testing import fake_kv_events as fe


FORMATS = list(fe.FORMATS)
BS = 4  # tokens per block


def blocks(tokens, salt=0):
    return fe.chain(tokens, BS, salt)


def feed(index, src, fmt, *events):
    """Encode `events` in format `fmt` as an engine would, decode them, apply them to `index` from `src`."""
    return index.apply(src, decode_batch(fe.encode_batch(fmt, list(events)))[1])


def endpoints():
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def wait(check, timeout=5.0):
    return eventually(check, timeout, interval=0.01)


def publish(pub, fmt, tokens, salt=0):
    h = blocks(tokens, salt)
    return pub.publish(fe.encode_batch(fmt, [fe.stored(fmt, h, None, tokens, BS)]))
