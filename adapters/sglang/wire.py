"""Messages between a decode and a prefill manager of the pdsdk backend (msgpack, never pickle).

They ride SGLang's own ZMQ PUSH -> PULL control sockets (each manager binds one PULL socket and
publishes it through the bootstrap server), as two frames: a tag and one msgpack body.
- decode -> prefill, once per prefill rank: `Registration` (transport descriptor, buffer shapes)
- decode -> prefill, per request: `TransferRequest` (room, destination pages and metadata slot)
- prefill -> decode, per request: `TransferStatus` (Success, or Failed with the reason)
SGLang's own ABORT frames (`[b"ABORT", room, ...]`, sent by CommonKVReceiver.abort) are handled too.
"""

from __future__ import annotations

import msgspec

TAG = b"PDSDK"
STATUS_TAG = b"PDSDK_STATUS"
ABORT_TAG = b"ABORT"  # SGLang's CommonKVReceiver abort notification (both supported versions)


class Registration(msgspec.Struct, tag="reg", kw_only=True):
    agent: str  # the decode manager's transport agent: keys its transfer requests
    ip: str  # decode's PULL socket, where statuses go
    port: int
    descriptor: bytes  # pdsdk transport descriptor (regions: KV buffers, then aux buffers)
    transport: str
    tp_size: int
    tp_rank: int
    page_size: int
    kv_item_lens: list[int]
    aux_item_lens: list[int]


class TransferRequest(msgspec.Struct, tag="req", kw_only=True):
    room: int
    agent: str
    ip: str
    port: int
    kv_indices: bytes  # int32 page ids, native order (numpy tobytes)
    aux_index: int | None
    required_dst_info_num: int
    decode_prefix_len: int = 0
    is_dummy: bool = False
    has_state: bool = False  # hybrid models' state slots: not supported by this backend yet


class TransferStatus(msgspec.Struct, kw_only=True):
    room: int
    status: int  # KVPoll value
    rank: int  # the prefill rank that sends it
    reason: str | None = None


Message = Registration | TransferRequest
_decoder = msgspec.msgpack.Decoder(Message)
_status_decoder = msgspec.msgpack.Decoder(TransferStatus)


def encode(msg: Message) -> list[bytes]:
    return [TAG, msgspec.msgpack.encode(msg)]


def decode(frames: list[bytes]) -> Message:
    return _decoder.decode(frames[1])


def encode_status(status: TransferStatus) -> list[bytes]:
    return [STATUS_TAG, msgspec.msgpack.encode(status)]


def decode_status(frames: list[bytes]) -> TransferStatus:
    return _status_decoder.decode(frames[1])
