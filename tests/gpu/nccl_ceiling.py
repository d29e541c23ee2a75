"""GPU machine: the NCCL send/recv ceiling between GPU0 and GPU1 (two processes), beside pdsdk's transports.
Usage: python3 tests/gpu/nccl_ceiling.py  -> prints and writes $OUT/nccl-ceiling.json"""

import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = {"151 MB (paged case)": 4608 * 32768, "1 GiB": 1 << 30}


def worker(rank: int, port: int, q) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    for name, n in SIZES.items():
        buf = torch.ones(n, dtype=torch.uint8, device=f"cuda:{rank}")
        times = []
        for _ in range(11):
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        med = statistics.median(times[1:])
        out[name] = {"bytes": n, "ms": med * 1e3, "gbps": n / med / 1e9}
    if rank == 1:
        q.put(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(60)
    Path(os.environ.get("OUT", "/tmp/out"), "nccl-ceiling.json").write_text(json.dumps(res, indent=2))
    for k, v in res.items():
        print(f"nccl send/recv {k}: {v['ms']:.3f} ms, {v['gbps']:.1f} GB/s")
