"""What a plugin author and an integrator import: `pdsdk`'s names, `open_transport`, and the
constructor contract the hookspecs document."""

import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pdsdk
from pdsdk import ConfigError, KVLayout, Span, TransportError, open_transport
from pdsdk.connectors.transports.common.buffers import allocate
from pdsdk.hookspecs import TransportFactory
from pdsdk.plugins import plugin_manager, reset

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, page_size=32)
PUBLIC = ("hookimpl", "Transport", "Store", "Policy", "Hints", "load_config", "open_store", "open_transport")


def test_public_names_and_import_pdsdk_stays_light():
    """The router imports pdsdk: it must not pay for numpy (and its BLAS threads) until a name needs it."""
    code = ("import sys, pdsdk\n"
            "from pdsdk import hookimpl, Store, Hints, load_config, open_store, Policy\n"
            "assert 'numpy' not in sys.modules, 'numpy loaded'\n"
            f"from pdsdk import {', '.join(PUBLIC)}\n"
            "assert issubclass(pdsdk.Transport, object) and callable(open_transport)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path("/"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert set(PUBLIC) <= set(pdsdk.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        pdsdk.Nope  # noqa: B018


@pytest.mark.parametrize("spec", ["fake", {"name": "fake"}, {"name": "fake", "options": {"drop": True}}])
def test_open_transport_takes_a_name_or_a_spec(spec):
    with open_transport(spec, layout=LAYOUT, host="127.0.0.1", transfer_timeout_s=3.0) as t:
        assert t.name == "fake" and t.transfer_timeout_s == 3.0
        assert t.options["drop"] is (isinstance(spec, dict) and "options" in spec)


def test_open_transport_names_a_bad_option_or_transport():
    with pytest.raises(ConfigError) as e:
        open_transport({"name": "fake", "options": {"drop": "yes"}}, layout=LAYOUT)
    assert e.value.field == "transport.options.drop"
    with pytest.raises(ConfigError, match="transport.options.nosuch: unknown option"):
        open_transport("fake", layout=LAYOUT, nosuch=1)
    with pytest.raises(ConfigError, match="unknown transport 'carrier-pigeon'"):
        open_transport("carrier-pigeon", layout=LAYOUT)
    with pytest.raises(ConfigError, match="no transport named"):
        open_transport("none", layout=LAYOUT)


def test_transport_factory_contract_is_what_open_transport_passes():
    """hookspecs.TransportFactory documents the constructor call: it must be the one made."""
    calls = []

    class Recorder:
        OPTIONS: dict = {}

        def __init__(self, **kwargs):
            calls.append(kwargs)

    class Plugin:
        @pdsdk.hookimpl
        def pdsdk_add_transports(self, registrar):
            registrar.add("recorder", f"{__name__}:RECORDER")

    globals()["RECORDER"] = Recorder
    reset()
    plugin_manager().register(Plugin())
    try:
        open_transport("recorder", layout=LAYOUT)
    finally:
        reset()
    documented = [p.name for p in inspect.signature(TransportFactory.__call__).parameters.values()
                  if p.kind is p.KEYWORD_ONLY]
    assert sorted(calls[0]) == sorted(documented)


def pair(**options):
    a = open_transport("fake", layout=LAYOUT, **options)
    b = open_transport("fake", layout=LAYOUT)
    bufs = []
    for t in (a, b):
        buf, region = allocate(1 << 16)
        t.register([region])
        bufs.append(buf)
    return a, b, a.connect(b.descriptor()), bufs


def test_fake_moves_bytes_or_drops_them_when_asked():
    for drop in (False, True):
        a, b, peer, (mine, theirs) = pair(drop=drop)
        theirs[:] = np.random.default_rng(1).integers(0, 256, len(theirs), dtype=np.uint8)
        mine[:] = 0
        assert a.wait(a.read(peer, [Span(0, 0, 4096)], [Span(0, 8192, 4096)], notify=b"n")).state == "done"
        assert bytes(mine[:4096]) == (bytes(4096) if drop else bytes(theirs[8192:12288]))
        assert b.notifications() == [(a.agent, b"n")]
        a.close()
        b.close()


def test_fake_refuses_a_peer_outside_this_process_and_fails_one_that_closed():
    a, b, peer, _ = pair()
    other = subprocess.run([sys.executable, "-c", "import sys; from pdsdk import open_transport, KVLayout; "
                            "sys.stdout.buffer.write(open_transport('fake', layout=KVLayout(num_layers=1, "
                            "num_kv_heads=1, head_dim=64, page_size=32)).descriptor())"],
                           capture_output=True, check=True).stdout
    with pytest.raises(TransportError, match="is not a transport of this process"):
        a.connect(other)
    b.close()
    status = a.wait(a.read(peer, [Span(0, 0, 4096)], [Span(0, 0, 4096)]))
    assert status.state == "failed" and "is closed" in status.reason
    a.close()


def test_corrupt_reads_fault_lands_other_bytes_than_were_read(caplog):
    from pdsdk.testing.faults import CorruptReads

    t = CorruptReads(name="corrupt_reads", inner="fake", layout=LAYOUT, host="127.0.0.1",
                     transfer_timeout_s=5.0, connect_timeout_s=5.0)
    b = open_transport("fake", layout=LAYOUT)
    (mine, r1), (theirs, r2) = allocate(1 << 16), allocate(1 << 16)
    t.register([r1])
    b.register([r2])
    theirs[:] = 7
    peer = t.connect(b.descriptor())
    assert t.wait(t.read(peer, [Span(0, 0, 8192)], [Span(0, 0, 8192)])).state == "done"
    assert (mine[:8192] != 7).mean() > 0.9 and (mine[8192:] == 0).all() and (theirs == 7).all()
    assert t.name == "fake" and "scribbled over the 8192 bytes" in caplog.text
    t.close()
    b.close()
