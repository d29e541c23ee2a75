"""One engine's KV event stream into the index: ZMQ SUB, sequence tracking, replay, resync.

- Start: replay from seq 0 (the publisher's buffer), so the index starts from what the engine
  still remembers instead of from whenever the router happened to connect.
- Gap (seq > last + 1): replay the missing range from the replay endpoint. When the buffer no
  longer reaches back or there is no replay endpoint, the source is cleared ("lossy"): better
  to forget than to route on blocks that may have been removed meanwhile.
- Restart: a lower seq, a new publisher id (24-byte seq frames), or a reconnect after which the
  replay's batch at our last seq differs from the one we applied. The source is cleared and
  rebuilt from the new publisher's replay. AllBlocksCleared arrives as an event and is applied.
Runs in its own thread: ingest never competes with the request path's event loop for latency.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict

from pdsdk.router.kvindex import KVIndex
from pdsdk.router.kvindex.wire import END_SEQ, WireError, decode_batch, parse_seq

log = logging.getLogger(__name__)
RECENT = 4096  # applied batches remembered, to tell replay duplicates from a restarted engine


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class EventStream(threading.Thread):
    def __init__(self, source: str, endpoint: str, index: KVIndex, replay_endpoint: str | None = None,
                 topic: bytes = b"", replay_timeout_s: float = 2.0):
        super().__init__(name=f"kv-events {source}", daemon=True)
        self.source, self.endpoint, self.replay_endpoint = source, endpoint, replay_endpoint
        self.index, self.topic, self.replay_timeout_s = index, topic, replay_timeout_s
        self.last: int | None = None
        self._recent: OrderedDict[int, bytes] = OrderedDict()  # seq -> digest of applied batches
        self._publisher: bytes | None = None
        self.state = "starting"
        self.counts = dict.fromkeys(("batches", "blocks", "gaps", "replays", "lost", "restarts", "errors"), 0)
        self._halt = threading.Event()
        self.ready = threading.Event()  # set once connected and the initial replay is done

    # --- thread ---------------------------------------------------------------------------
    def run(self) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        connected_before = False
        self._resync(first=True)
        self.ready.set()
        try:
            while not self._halt.is_set():
                ready = dict(poller.poll(100))
                if monitor in ready:
                    ev = recv_monitor_message(monitor)
                    if ev["event"] == zmq.EVENT_CONNECTED:
                        if connected_before:  # publisher came back: same one, or a restarted engine?
                            self._resync(first=False)
                        connected_before = True
                    elif ev["event"] == zmq.EVENT_DISCONNECTED:
                        self.state = "disconnected"
                if sub in ready:
                    for _ in range(1000):  # drain in bursts, then look at the monitor again
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(frames)
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    def stop(self) -> None:
        self._halt.set()

    # --- messages -------------------------------------------------------------------------
    def _on_message(self, frames: list[bytes]) -> None:
        try:
            seq, publisher = parse_seq(frames[-2])
        except (WireError, IndexError) as e:
            self.counts["errors"] += 1
            log.warning("%s: bad KV event message: %s", self.source, e)
            return
        if publisher is not None and self._publisher is not None and publisher != self._publisher:
            self._restarted("new publisher id")
        self._publisher = publisher or self._publisher
        if self.last is not None:
            if seq <= self.last and self._recent.get(seq) == _digest(frames[-1]):
                return  # already applied (also delivered by a replay)
            if seq < self.last:
                self._restarted(f"seq went back from {self.last} to {seq}")
                self._catch_up(0, until=seq)
            elif seq > self.last + 1:
                self.counts["gaps"] += 1
                log.info("%s: KV events %d..%d missing; replaying", self.source, self.last + 1, seq - 1)
                self._catch_up(self.last + 1, until=seq)
        self._apply(seq, frames[-1])

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            _, events, _ = decode_batch(payload)
        except WireError as e:
            self.counts["errors"] += 1
            log.warning("%s: seq %d: %s", self.source, seq, e)
            events = []
        self.counts["blocks"] += self.index.apply(self.source, events)
        self.counts["batches"] += 1
        self.last = seq
        self._recent[seq] = _digest(payload)
        while len(self._recent) > RECENT:
            self._recent.popitem(last=False)
        if self.state not in ("lossy",):
            self.state = "exact"

    def _restarted(self, why: str) -> None:
        log.warning("%s: engine restarted (%s): dropping its indexed blocks", self.source, why)
        self.counts["restarts"] += 1
        self.index.clear(self.source)
        self.last, self.state = None, "exact"
        self._recent.clear()

    # --- replay ---------------------------------------------------------------------------
    def _catch_up(self, start: int, until: int | None = None) -> None:
        """Apply replayed batches start..until-1; clear the source if they cannot all be had."""
        got = self._replay(start)
        want = range(start, until) if until is not None else None
        have = [(s, p) for s, p in (got or []) if (until is None or s < until)]
        if got is None or (want is not None and [s for s, _ in have] != list(want)):
            self.counts["lost"] += 1
            log.warning("%s: KV events from %d cannot be replayed: index for it cleared (lossy)",
                        self.source, start)
            self.index.clear(self.source)
            self.state = "lossy"
            return
        for s, p in have:
            self._apply(s, p)

    def _resync(self, first: bool) -> None:
        """After (re)connecting: replay everything the publisher holds and decide whether it is
        the publisher we knew (its batch at our last seq matches) or a restarted engine."""
        got = self._replay(0)
        if got is None:
            if not first:
                self.state = "lossy" if self.last is not None else self.state
            return
        if self.last is not None:
            mine = [p for s, p in got if s == self.last]
            same = bool(mine) and _digest(mine[0]) == self._recent.get(self.last)
            if not same and (mine or not got or got[-1][0] < self.last):
                self._restarted("reconnected to a different publisher")
        for s, p in got:
            if self.last is None or s > self.last:
                if self.last is not None and s > self.last + 1:
                    self.counts["lost"] += 1
                    self.index.clear(self.source)
                    self.state = "lossy"
                self._apply(s, p)
        if self.state == "starting":  # the publisher had nothing yet: the index holds all it has
            self.state = "exact"

    def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Batches with seq >= start from the replay endpoint; None when it does not answer."""
        if not self.replay_endpoint:
            return None
        import zmq

        self.counts["replays"] += 1
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[tuple[int, bytes]] = []
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    log.warning("%s: replay from %d timed out", self.source, start)
                    return None
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                # [topic, seq, payload] (current engines) or [seq, payload] (older vLLM)
                seq, _ = parse_seq(frames[-2])
                if seq == END_SEQ:
                    return out
                out.append((seq, frames[-1]))
        except (WireError, IndexError) as e:
            log.warning("%s: bad replay reply: %s", self.source, e)
            return None
        finally:
            sock.close(0)

    def stats(self) -> dict:
        return {"endpoint": self.endpoint, "state": self.state, "last_seq": self.last, **self.counts}
