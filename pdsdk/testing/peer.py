"""The other side of a transfer for tests and benchmarks: a transport with one registered region,
driven by commands.

`start_peer` runs it where the transport can reach it: in its own interpreter (`PeerProcess`, the
real case), or in this process for transports whose peers live in one process (`IN_PROCESS`, such
as `fake`: `InProcessPeer`). Both answer the same commands, one reply each:
  {"cmd": "fill", "seed": 1}                     fill the region with seeded random bytes
  {"cmd": "digest", "spans": [[region, offset, length], ...]}   sha256 of those bytes
  {"cmd": "connect", "descriptor": b64}          connect to another peer (for peer-initiated ops)
  {"cmd": "notifications"}                       notifications received so far
  {"cmd": "stats"} / {"cmd": "exit"}
A peer process speaks JSON lines on stdin/stdout; the first line it writes is {"descriptor": b64, "pid": N}.
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

from pdsdk.connectors.transports.common.buffers import allocate, host_array, torch_view  # noqa: E402
from pdsdk.connectors.transports.factory import open_transport  # noqa: E402
from pdsdk.kv import KVLayout  # noqa: E402

SMALL_LAYOUT = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 64, "page_size": 32}  # 4 KiB pages


class PeerSide:
    """A transport with one region of `nbytes` on `device`, answering commands."""

    def __init__(self, transport: str, nbytes: int, *, device: str = "cpu", layout: dict | None = None,
                 options: dict | None = None, timeout: float = 30.0):
        self.device = device
        self.transport = open_transport(transport, layout=KVLayout(**{**SMALL_LAYOUT, **(layout or {})}),
                                        transfer_timeout_s=timeout, **(options or {}))
        self.buf, region = allocate(nbytes, device)
        self.transport.register([region])
        self.peers: list[Any] = []

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        cmd = msg.get("cmd")
        if cmd == "fill":
            fill(self.buf, msg["seed"], self.device)
            return {"ok": True}
        if cmd == "digest":
            return {"digest": digest(self.transport.regions, msg["spans"])}
        if cmd == "connect":
            self.peers.append(self.transport.connect(base64.b64decode(msg["descriptor"])))
            return {"ok": True}
        if cmd == "notifications":
            return {"notifications": [[a, base64.b64encode(m).decode()] for a, m in self.transport.notifications()]}
        if cmd == "stats":
            return {"stats": self.transport.stats()}
        return {"error": f"unknown command {cmd!r}"}


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
        if r.device == "cpu":
            h.update(host_array(r.addr + offset, length).tobytes())
        else:
            h.update(torch_view(r.addr + offset, length, r.device).cpu().numpy().tobytes())
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
    side = PeerSide(args.transport, args.bytes, device=args.device, layout=msgspec.json.decode(args.layout),
                    options=msgspec.json.decode(args.options), timeout=args.timeout)

    def reply(obj: dict) -> None:
        try:
            out.write(msgspec.json.encode(obj).decode() + "\n")
            out.flush()
        except BrokenPipeError:  # the parent is gone: nothing left to serve
            os._exit(0)

    reply({"descriptor": base64.b64encode(side.transport.descriptor()).decode(), "pid": os.getpid()})
    for line in sys.stdin:
        msg = msgspec.json.decode(line)
        if msg.get("cmd") == "exit":
            break
        reply(side.handle(msg))
    side.transport.close()
    reply({"ok": True})
    out.flush()
    os._exit(0)  # skip interpreter teardown: native libraries' exit handlers are not ours to debug


class PeerProcess:
    """The parent's handle on a peer process started with `python -m pdsdk.testing.peer`."""

    def __init__(self, transport: str, nbytes: int, *, device: str = "cpu", layout: dict | None = None,
                 options: dict | None = None, timeout: float = 30.0, env: dict | None = None):
        import subprocess

        # -P: do not put the working directory first on sys.path (a source checkout would shadow pdsdk)
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []
        cmd = [sys.executable, *safe_path, "-m", "pdsdk.testing.peer", "--transport", transport,
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


class InProcessPeer:
    """The peer as an object of this process, with PeerProcess's interface; `kill` closes its transport."""

    def __init__(self, transport: str, nbytes: int, **kwargs: Any):
        self.side = PeerSide(transport, nbytes, **kwargs)
        self.descriptor = self.side.transport.descriptor()
        self.pid = os.getpid()

    def call(self, cmd: str, **kwargs: Any) -> dict:
        # Through JSON, as from a process: the caller sees the same types either way.
        reply = msgspec.json.decode(msgspec.json.encode(self.side.handle({"cmd": cmd, **kwargs})))
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def kill(self) -> None:
        self.side.transport.close()

    close = kill


def start_peer(transport: str, nbytes: int, **kwargs: Any) -> PeerProcess | InProcessPeer:
    """The other side for `transport`: in its own process, or in this one when its peers must be."""
    from pdsdk.plugins import registry

    in_process = registry().load("transport", transport).IN_PROCESS
    return (InProcessPeer if in_process else PeerProcess)(transport, nbytes, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
