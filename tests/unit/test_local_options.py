"""The `local` transport's options: a bad GPU kernel name is refused by name; host copies ignore it."""

import numpy as np
import pytest
from helpers import span_digest
from pdsdk.connectors.transports.common.buffers import allocate
from pdsdk.testing.peer import PeerProcess

from pdsdk.errors import ConfigError
from pdsdk.kv import KVLayout, page_spans
from pdsdk.plugins import registry

LAYOUT = {"num_layers": 1, "num_kv_heads": 2, "head_dim": 32, "page_size": 32}


def make(**options):
    return registry().load("transport", "local")(name="local", layout=KVLayout(**LAYOUT), **options)


def test_unknown_gpu_kernel_names_the_option():
    with pytest.raises(ConfigError, match="transport.options.gpu_kernel.*'cutlass' is not one of: auto, triton, torch"):
        make(gpu_kernel="cutlass")


def test_triton_option_leaves_host_pages_bit_exact():
    t = make(gpu_kernel="triton")
    buf, region = allocate(1 << 20, "cpu")
    t.register([region])
    peer = PeerProcess("local", 1 << 20, layout=LAYOUT)
    try:
        remote = t.connect(peer.descriptor)
        peer.call("fill", seed=3)
        pb = t.layout.page_bytes
        ids = np.random.default_rng(0).permutation((1 << 20) // pb)[:20]
        assert t.wait(t.read_pages(remote, 0, ids, 0, ids[::-1].copy())).state == "done"
        theirs = peer.call("digest", spans=page_spans(0, ids[::-1].copy(), pb).tolist())["digest"]
        assert span_digest(buf, page_spans(0, ids, pb)) == theirs
    finally:
        peer.close()
        t.close()
