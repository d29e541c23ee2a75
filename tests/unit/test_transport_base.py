"""What the transport base class guarantees to every transport: deadlines, path warnings, options.

A minimal in-process backend stands in for a library here; every real transport runs the same
contract between processes in tests/conformance/test_transports.py.
"""

import time

import msgspec
import pytest

from pdsdk import ConfigError, KVLayout, Region, Span
from pdsdk.connectors.transports.base import Transport
from pdsdk.connectors.transports.common.staging import prefer_staged
from pdsdk.connectors.transports.common.status import STATUS_DONE, STATUS_PENDING

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, page_size=32)


class Scripted(Transport):
    """Transfers finish after `delay` seconds (None: never)."""

    OPTIONS = {"delay": 0.0}

    def _path(self):
        return "scripted"

    def _register(self, regions):
        pass

    def _connect(self, d, peer):
        return None

    def _post(self, op, peer, local, remote, notify):
        delay = self.options["delay"]
        return None if delay is None else time.monotonic() + delay

    def _poll(self, due):
        return STATUS_DONE if due is not None and time.monotonic() >= due else STATUS_PENDING

    def _notifications(self):
        return []

    def _close(self):
        pass


def connected(device="cpu", **options):
    a = Scripted(name="scripted", layout=LAYOUT, transfer_timeout_s=0.3, **options)
    b = Scripted(name="scripted", layout=LAYOUT)
    for t in (a, b):
        t.register([Region(0x10000, 64 << 20, device)])
    return a, a.connect(b.descriptor())


def test_a_transfer_that_never_finishes_fails_at_its_deadline():
    t, peer = connected(delay=None)
    start = time.monotonic()
    status = t.wait(t.read(peer, [Span(0, 0, 4096)], [Span(0, 0, 4096)]))
    assert status.state == "failed" and "deadline of 0.3s passed" in status.reason
    assert 0.3 <= time.monotonic() - start < 2
    assert t.stats()["failed"] == 1


def test_close_fails_pending_transfers():
    t, peer = connected(delay=None)
    h = t.read(peer, [Span(0, 0, 4096)], [Span(0, 0, 4096)])
    t.close()
    assert t.poll(h).state == "failed" and t.poll(h).reason == "transport closed"


def test_slow_gpu_path_is_reported_loudly(caplog):
    t, peer = connected(device="cuda:0", delay=0.05)  # 32 MiB in 50 ms: 0.7 GB/s, a host path
    for _ in range(4):  # the first pays for setup; the fastest of the next three judges the path
        assert "WARNING" not in t.path()
        assert t.wait(t.read(peer, [Span(0, 0, 32 << 20)], [Span(0, 0, 32 << 20)])).state == "done"
    assert "WARNING: VRAM->VRAM ran at" in t.path() and "CUDA IPC" in t.path()
    assert t.stats()["path_warning"] and "went through the host" in caplog.text


def test_one_slow_transfer_on_a_fast_path_is_no_host_path():
    t, peer = connected(device="cuda:0", delay=0.0)  # 32 MiB "instantly": a P2P path
    for delay in (0.0, 0.0, 0.05, 0.0, 0.05):  # a busy GPU slows some transfers
        t.options["delay"] = delay
        assert t.wait(t.read(peer, [Span(0, 0, 32 << 20)], [Span(0, 0, 32 << 20)])).state == "done"
    assert "WARNING" not in t.path() and not t.stats()["path_warning"]


def test_a_transport_without_a_host_path_never_claims_one(monkeypatch):
    monkeypatch.setattr(Scripted, "MAY_TAKE_HOST_PATH", False)  # as `local` (CUDA IPC or nothing)
    t, peer = connected(device="cuda:0", delay=0.05)
    for _ in range(5):
        assert t.wait(t.read(peer, [Span(0, 0, 32 << 20)], [Span(0, 0, 32 << 20)])).state == "done"
    assert "WARNING" not in t.path() and not t.stats()["path_warning"]


def test_many_scattered_runs_are_not_judged_as_a_host_path():
    t, peer = connected(device="cuda:0", delay=0.05)
    pages = [Span(0, i * (64 << 10), 32 << 10) for i in range(512)]  # 16 MiB in 512 runs: descriptor-bound
    for _ in range(5):
        assert t.wait(t.read(peer, pages, pages)).state == "done"
    assert "WARNING" not in t.path() and not t.stats()["path_warning"]


def test_host_memory_is_not_held_to_gpu_rates():
    t, peer = connected(device="cpu", delay=0.05)
    t.wait(t.read(peer, [Span(0, 0, 32 << 20)], [Span(0, 0, 32 << 20)]))
    assert "WARNING" not in t.path()


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(ConfigError, match=r"transport.options.dleay.*valid: delay"):
        Scripted(name="scripted", layout=LAYOUT, dleay=1)


def test_descriptor_is_msgpack_not_pickle():
    t, _ = connected()
    decoded = msgspec.msgpack.decode(t.descriptor())
    assert decoded["transport"] == "scripted" and decoded["layout"]["page_size"] == 32


def test_cost_rule_stages_small_gpu_pages_and_not_host_pages():
    assert prefer_staged(4608, 4608 * 32768, "cuda:0")  # 151 MB: gather 0.2 ms vs 41 ms of descriptors
    assert not prefer_staged(4608, 4608 * 32768, "cpu")  # numpy gather costs more than it saves
    assert not prefer_staged(1, 1 << 30, "cuda:0")  # one run needs no staging


def test_transports_left_open_are_closed_at_exit(monkeypatch):
    """Native threads of a transport nobody closed abort a process at interpreter exit."""
    import weakref

    from pdsdk.connectors.transports import base

    monkeypatch.setattr(base, "_live", weakref.WeakSet())  # only this test's transports
    t, peer = connected(delay=None)
    h = t.read(peer, [Span(0, 0, 4096)], [Span(0, 0, 4096)])
    assert t in base._live
    base._close_all()  # what atexit runs
    assert t.closed and t.poll(h).reason == "transport closed" and t not in base._live
