"""Profile the local transport's CUDA IPC path (peer in another process, on PEER=cuda:N, default cuda:0),
with the page kernel KERNEL=torch|triton (default torch)."""
import cProfile
import os
import pstats
import time

import numpy as np
import torch

from pdsdk.connectors.transports.common.buffers import allocate
from pdsdk.kv import KVLayout, Span, page_spans
from pdsdk.plugins import registry
from pdsdk.testing.peer import PeerProcess

pb, n = 32768, 4608
N = 2 * n * pb
layout = {"num_layers": 1, "num_kv_heads": 8, "head_dim": 64, "page_size": 32}
peer = PeerProcess("local", N, device=os.environ.get("PEER", "cuda:0"), layout=layout)
t = registry().load("transport", "local")(name="local", layout=KVLayout(**layout, device="cuda:0"),
                                         gpu_kernel=os.environ.get("KERNEL", "torch"))
buf, reg = allocate(N, "cuda:0")
t.register([reg])
p = t.connect(peer.descriptor)
rng = np.random.default_rng(0)
L, R = page_spans(0, rng.permutation(N // pb)[:n], pb), page_spans(0, rng.permutation(N // pb)[:n], pb)
C = [Span(0, 0, 1 << 20)]
for spans, name in ((C, "1MiB"), (None, "paged")):
    for _ in range(3):
        t.wait(t.read(p, spans or L, spans or R))
    times = []
    for _ in range(20):
        s = time.perf_counter(); t.wait(t.read(p, spans or L, spans or R)); times.append(time.perf_counter() - s)
    print(name, "median ms", np.median(times) * 1e3)
prof = cProfile.Profile()
prof.enable()
for _ in range(20):
    t.wait(t.read(p, L, R))
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(12)
# the kernels alone
from pdsdk.connectors.transports.common.packing import copy_pages
lp, rp = buf.view(-1, pb), buf.view(-1, pb)
li, ri = rng.permutation(N // pb)[:n], rng.permutation(N // pb)[:n]
torch.cuda.synchronize(); s = time.perf_counter()
for _ in range(20):
    copy_pages(lp, li, rp, ri)
torch.cuda.synchronize(); print("copy_pages alone ms", (time.perf_counter() - s) / 20 * 1e3)
s = time.perf_counter()
for _ in range(20):
    h = t.read(p, L, R)
post = (time.perf_counter() - s) / 20
for h2 in range(h - 19, h + 1):
    t.wait(h2)
print("post only ms", post * 1e3)
lids, rids = L[:, 1] // pb, R[:, 1] // pb
for _ in range(3):
    t.wait(t.read_pages(p, 0, lids, 0, rids))
times = []
for _ in range(20):
    s = time.perf_counter(); t.wait(t.read_pages(p, 0, lids, 0, rids)); times.append(time.perf_counter() - s)
print("read_pages paged median ms", np.median(times) * 1e3)
peer.close(); t.close()
