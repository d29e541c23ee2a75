"""What a side sends its peer out of band (its descriptor), and what it keeps of a connected peer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdsdk.kv import KVLayout, Region


class Descriptor(msgspec.Struct, frozen=True, kw_only=True):
    """Sent as msgpack, never pickle."""

    transport: str
    agent: str
    host: str
    layout: KVLayout
    regions: list[Region]
    meta: dict[str, Any] = {}  # backend handshake material


@dataclass
class Peer:
    """A connected remote side."""

    agent: str
    host: str
    regions: list[Region]
    layout: KVLayout
    backend_meta: dict[str, Any] = field(default_factory=dict)  # the peer's descriptor meta
    backend: Any = None  # whatever the transport keeps per peer

    @property
    def all_regions(self) -> list[Region]:
        """The peer's regions plus its staging buffer (last), for address lookups."""
        staging = self.backend_meta.get("staging")
        return self.regions + ([Region(*staging)] if staging else [])
