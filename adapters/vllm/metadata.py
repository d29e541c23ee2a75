"""What the scheduler side tells the workers each step, and what workers publish at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata


@dataclass
class Receive:
    """Decode side: pull `remote_block_ids` of the prefill engine into our `local_block_ids`."""

    local_block_ids: list[int]
    remote_block_ids: list[int]
    engine_id: str
    request_id: str  # the prefill engine's id of the request
    host: str
    port: int
    tp_size: int
    lease_expiry: float | None = None  # time.time() after which the prefill may reuse its blocks


@dataclass
class StorePages:
    """Blocks to load from (or save to) the store, and vLLM's hashes of those blocks (the keys)."""

    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass
class PdsdkMetadata(KVConnectorMetadata):
    receive: dict[str, Receive] = field(default_factory=dict)  # our request id -> what to pull
    send: dict[str, float] = field(default_factory=dict)  # request id -> lease expiry (time.time())
    load: dict[str, StorePages] = field(default_factory=dict)  # request id -> prefix pages to load
    save: list[StorePages] = field(default_factory=list)  # pages computed this step, to store


@dataclass
class PdsdkHandshake(KVConnectorHandshakeMetadata):
    """One worker's transport descriptor (empty without a transport), the byte geometry of its KV cache
    per layer, and the key namespace of its store pages (a KeySpace as a dict; None without a store)."""

    tp_rank: int
    descriptor: bytes
    geometry: list[list[int]]  # per layer: [planes, plane_stride, block_stride, block_bytes]
    # per layer: [tokens, token_stride, head_stride, chunk] (pdsdk.kv.HeadGeometry); None: pages can't be
    # sliced by KV head (heterogeneous TP refused)
    heads: list[list[int]] | None = None
    store_keyspace: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
