"""What the router's processes tell each other over their local sockets (msgpack, typed)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from pdsdk.router.processes.load_table import SLOTS


class WorkerRecord(msgspec.Struct, frozen=True):
    """One worker as every serving process must see it."""

    url: str
    role: str
    bootstrap_port: int | None
    kv_events: str | None
    kv_replay: str | None
    source: str
    healthy: bool
    draining: bool
    models: list[str]
    last_error: str | None
    slot: Annotated[int, msgspec.Meta(ge=0, lt=SLOTS)]  # its column in the shared load table


class Snapshot(msgspec.Struct, frozen=True):
    """The whole worker set; `seq` grows with each change (a repeat of the same seq changes nothing)."""

    seq: int
    workers: list[WorkerRecord]


class AddWorker(msgspec.Struct, tag="add"):
    url: str
    role: str
    bootstrap_port: int | None = None
    kv_events: str | None = None
    kv_replay: str | None = None


class RemoveWorker(msgspec.Struct, tag="remove"):
    url: str


class DrainWorker(msgspec.Struct, tag="drain"):
    url: str
    remove: bool = True


class Ready(msgspec.Struct, tag="ready"):
    """A serving process listens now."""

    index: int
    pid: int


Call = AddWorker | RemoveWorker | DrainWorker | Ready  # a serving process -> the primary


class Reply(msgspec.Struct):
    status: int  # the admin API's HTTP status
    body: dict[str, Any] = {}  # its JSON body, when it succeeded
    error: str | None = None  # else why not
    seq: int = 0  # the snapshot that holds the change


encode = msgspec.msgpack.encode
decode_call = msgspec.msgpack.Decoder(Call).decode
decode_reply = msgspec.msgpack.Decoder(Reply).decode
decode_snapshot = msgspec.msgpack.Decoder(Snapshot).decode
