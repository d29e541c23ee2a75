"""A transport peer in its own process, driven over stdin/stdout with JSON lines.

Used by the conformance tests and `pdsdk bench transport`: the other side of every transfer
is a real separate process. Commands (one JSON object per line, one reply each):
  {"cmd": "fill", "seed": 1}                     fill the region with seeded random bytes
  {"cmd": "digest", "spans": [[region, offset, length], ...]}   sha256 of those bytes
  {"cmd": "connect", "descriptor": b64}          connect to another peer (for peer-initiated ops)
  {"cmd": "notifications"}                       notifications received so far
  {"cmd": "stats"} / {"cmd": "exit"}
The first line written is {"descriptor": b64, "pid": N}.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import sys
from typing import Any

import msgspec

os.environ.setdefault("UCX_MODULES", "^ib")  # see connectors/transports/nixl.py

from pdsdk.connectors.transports.buffers import allocate, torch_view  # noqa: E402
from pdsdk.kv import KVLayout  # noqa: E402
from pdsdk.plugins import registry  # noqa: E402


def fill(buf: Any, seed: int, device: str) -> None:
    import numpy as np

    data = np.random.default_rng(seed).integers(0, 256, size=len(buf), dtype=np.uint8)
    if device == "cpu":
        buf[:] = data
    else:
        import torch

        buf.copy_(torch.from_numpy(data))


def digest(regions: list, spans: list[list[int]]) -> str:
    h = hashlib.sha256()
    for region, offset, length in spans:
        r = regions[region]
        view = torch_view(r.addr + offset, length, r.device) if r.device != "cpu" else None
        if view is None:
            from pdsdk.connectors.transports.buffers import host_array

            h.update(host_array(r.addr + offset, length).tobytes())
        else:
            h.update(view.cpu().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", required=True)
    p.add_argument("--bytes", type=int, required=True, help="size of the one region this peer registers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--layout", default="{}", help="KVLayout fields as JSON")
    p.add_argument("--options", default="{}", help="transport options as JSON")
    p.add_argument("--timeout", type=float, default=30.0, help="transfer deadline in seconds")
    args = p.parse_args(argv)
    # Keep the protocol on a private copy of stdout: libraries (NIXL) log to stdout.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    layout = KVLayout(**{"num_layers": 1, "num_kv_heads": 1, "head_dim": 64, "page_size": 32,
                         **msgspec.json.decode(args.layout)})
    cls = registry().load("transport", args.transport)
    transport = cls(name=args.transport, layout=layout, transfer_timeout_s=args.timeout,
                    **msgspec.json.decode(args.options))
    buf, region = allocate(args.bytes, args.device)
    transport.register([region])

    def reply(obj: dict) -> None:
        try:
            out.write(msgspec.json.encode(obj).decode() + "\n")
            out.flush()
        except BrokenPipeError:  # the parent is gone: nothing left to serve
            os._exit(0)

    reply({"descriptor": base64.b64encode(transport.descriptor()).decode(), "pid": os.getpid()})
    peers = []
    for line in sys.stdin:
        msg = msgspec.json.decode(line)
        cmd = msg.get("cmd")
        if cmd == "fill":
            fill(buf, msg["seed"], args.device)
            reply({"ok": True})
        elif cmd == "digest":
            reply({"digest": digest(transport.regions, msg["spans"])})
        elif cmd == "connect":
            peers.append(transport.connect(base64.b64decode(msg["descriptor"])))
            reply({"ok": True})
        elif cmd == "notifications":
            reply({"notifications": [[a, base64.b64encode(m).decode()] for a, m in transport.notifications()]})
        elif cmd == "stats":
            reply({"stats": transport.stats()})
        elif cmd == "exit":
            break
        else:
            reply({"error": f"unknown command {cmd!r}"})
    transport.close()
    reply({"ok": True})
    out.flush()
    os._exit(0)  # skip interpreter teardown: native libraries' exit handlers are not ours to debug


if __name__ == "__main__":
    sys.exit(main())


class PeerProcess:
    """The parent's handle on a peer process started with `python -m ...peer`."""

    def __init__(self, transport: str, nbytes: int, *, device: str = "cpu", layout: dict | None = None,
                 options: dict | None = None, timeout: float = 30.0, env: dict | None = None):
        import subprocess

        # -P: do not put the working directory first on sys.path (a source checkout would shadow pdsdk)
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []
        cmd = [sys.executable, *safe_path, "-m", "pdsdk.connectors.transports.peer", "--transport", transport,
               "--bytes", str(nbytes), "--device", device, "--layout", msgspec.json.encode(layout or {}).decode(),
               "--options", msgspec.json.encode(options or {}).decode(), "--timeout", str(timeout)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        first = self._read()
        self.descriptor = base64.b64decode(first["descriptor"])
        self.pid = first["pid"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(30)
            raise RuntimeError(f"transport peer exited with code {code} before answering (see its stderr)")
        return msgspec.json.decode(line)

    def call(self, cmd: str, **kwargs: Any) -> dict:
        self.proc.stdin.write(msgspec.json.encode({"cmd": cmd, **kwargs}).decode() + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit")
                self.proc.wait(30)
            except (OSError, RuntimeError, ValueError):
                self.proc.kill()
                self.proc.wait(30)
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
