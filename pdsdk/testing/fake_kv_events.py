"""A KV event publisher that speaks the engines' exact wire formats, for tests and the bench.

The structs mirror the engines' own msgspec definitions (vllm/distributed/kv_events.py,
sglang/srt/disaggregation/kv_events.py):
- "vllm": events are maps tagged "type" (vLLM 0.33); "vllm-array": positional arrays (older vLLM);
- "sglang": maps, None-valued optionals omitted (>= 0.5.20); "sglang-array": arrays (<= 0.5.15).
The batch is always the array [ts, events, data_parallel_rank].
The publisher binds PUB and a ROUTER replay socket and keeps a replay buffer, like the engines;
`drop_next` loses messages on the way out (sequence advances, nothing sent) to test gap repair.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Union

import msgspec

Hash = Union[int, bytes]


def _family(array: bool, omit: bool, vllm_fields: bool) -> dict[str, type]:
    class KVCacheEvent(msgspec.Struct, array_like=array, omit_defaults=omit, gc=False, tag=True):
        pass

    if vllm_fields:
        class BlockStored(KVCacheEvent):
            block_hashes: list[Hash]
            parent_block_hash: Hash | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None = None
            extra_keys: list | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[Hash]
            medium: str | None
            group_idx: int | None = None
    else:
        class BlockStored(KVCacheEvent):
            block_hashes: list[Hash]
            parent_block_hash: Hash | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None = None
            medium: str | None = None
            cache_salt: str | None = None
            session_id: str | None = None
            lora_name: str | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[Hash]
            medium: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
        data_parallel_rank: int | None = None

    return {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared,
            "KVEventBatch": KVEventBatch}


FORMATS = {"vllm": _family(False, False, True), "vllm-array": _family(True, True, True),
           "sglang": _family(False, True, False), "sglang-array": _family(True, True, False)}
_enc = msgspec.msgpack.Encoder()


def stored(fmt: str, hashes: list, parent, token_ids: list[int], block_size: int, **kw: Any):
    cls = FORMATS[fmt]["BlockStored"]
    if fmt.startswith("vllm"):  # what vLLM 0.32 sends for plain text (seen on the wire)
        kw.setdefault("lora_id", None)
        kw.setdefault("medium", "GPU")
        kw.setdefault("extra_keys", [None] * len(hashes))
        kw.setdefault("group_idx", 0)
        kw.setdefault("kv_cache_spec_kind", "full_attention")
    return cls(block_hashes=hashes, parent_block_hash=parent, token_ids=token_ids, block_size=block_size, **kw)


def removed(fmt: str, hashes: list, **kw: Any):
    if fmt.startswith("vllm"):
        kw.setdefault("medium", "GPU")
    return FORMATS[fmt]["BlockRemoved"](block_hashes=hashes, **kw)


def cleared(fmt: str):
    return FORMATS[fmt]["AllBlocksCleared"]()


def encode_batch(fmt: str, events: list, rank: int | None = 0) -> bytes:
    return _enc.encode(FORMATS[fmt]["KVEventBatch"](ts=time.time(), events=events, data_parallel_rank=rank))


def chain(token_ids: list[int], block_size: int, salt: int = 0) -> list[int]:
    """Engine-like chained block hashes (any stable function will do: the router never recomputes them)."""
    out, h = [], salt
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[i:i + block_size]), "engine")) & ((1 << 64) - 1)
        out.append(h)
    return out


class Publisher:
    """Binds PUB at `endpoint` and ROUTER at `replay`; seq starts at 0 like the engines."""

    def __init__(self, endpoint: str, replay: str | None, topic: bytes = b"", buffer_steps: int = 10_000):
        import zmq

        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.bind(endpoint)
        self.topic, self.seq, self.drop = topic, 0, 0
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.rep = None
        if replay:
            self.rep = self.ctx.socket(zmq.ROUTER)
            self.rep.setsockopt(zmq.LINGER, 0)
            self.rep.bind(replay)
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def publish(self, payload: bytes) -> int:
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            if self.drop > 0:
                self.drop -= 1
            else:
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def drop_next(self, n: int) -> None:
        self.drop += n

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.rep.poll(50):
                continue
            client, _, start = self.rep.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                items = [(s, p) for s, p in self.buffer if s >= start_seq]
            for s, p in items:
                self.rep.send_multipart([client, b"", self.topic, s.to_bytes(8, "big"), p])
            self.rep.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        if self.rep is not None:
            self._thread.join(2)
            self.rep.close(0)
        self.pub.close(0)
