"""Sender, receiver and bootstrap server of the pdsdk transfer backend.

They subclass SGLang's Common classes for the parts the scheduler relies on beyond the ABC (room
bookkeeping, bootstrap lookups, timeouts, abort) and implement the rest themselves, so the same
code runs on 0.5.15.post1, whose Common sender/receiver leave send/poll/send_metadata empty, and on
0.5.23, where they are backend hooks (SGLang's disaggregation/common/conn.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer, CommonKVReceiver, CommonKVSender, KVTransferError,
)

from pdsdk.adapters.sglang import wire
from pdsdk.adapters.sglang.manager import PdsdkKVManager

log = logging.getLogger(__name__)
_FINAL = (KVPoll.Success, KVPoll.Failed)


def _raise_failure(obj: Any) -> None:
    with obj.kv_mgr.failure_lock:
        reason = obj.kv_mgr.failure_records.pop(obj.bootstrap_room, None)
    raise KVTransferError(obj.bootstrap_room, reason or "Failed due to an unknown reason from another rank")


class PdsdkKVSender(CommonKVSender):
    kv_mgr: PdsdkKVManager

    def __init__(self, mgr: PdsdkKVManager, bootstrap_addr: str, bootstrap_room: int, *args: Any, **kwargs: Any):
        # Signatures differ by version (compat.sender_init_params): pass them through untouched.
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
        if self.conclude_state is None and getattr(self, "init_time", None) is None:
            self.init_time = time.time()  # 0.5.15 never starts the bootstrap timeout clock

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None,
             *_: Any, **__: Any) -> None:
        if self.conclude_state in _FINAL:
            return
        kv_indices, index_slice, is_last, skip = self._prepare_send_indices(kv_indices, state_indices)
        if skip:
            return
        self.kv_mgr.add_transfer_request(self.bootstrap_room, kv_indices, index_slice, is_last,
                                         aux_index=self.aux_index if is_last else None,
                                         state_indices=state_indices if is_last else None)
        self._record_transfer_indices(kv_indices, state_indices)

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        status = self.kv_mgr.check_status(self.bootstrap_room)
        if status == KVPoll.Bootstrapping:
            timed_out = self._check_bootstrap_timeout()
            if timed_out is not None:
                status = timed_out
        if status in _FINAL:
            self.conclude_state = status
        return status

    def poll_pp_consensus(self) -> KVPoll:
        return self.poll()

    def failure_exception(self) -> None:
        self.conclude_state = KVPoll.Failed
        self.clear()
        _raise_failure(self)


class PdsdkKVReceiver(CommonKVReceiver):
    kv_mgr: PdsdkKVManager

    def _register_kv_args(self) -> bool:
        """Tell each prefill rank of this request where our buffers are (once per rank: SGLang
        caches the bootstrap infos per prefill address and calls this only for new ones)."""
        if getattr(self, "bootstrap_infos", None) is None:
            return False
        message = self.kv_mgr.registration()
        return all(self._push(info, message) for info in self.bootstrap_infos)

    def _push(self, info: dict, frames: list[bytes]) -> bool:
        try:
            sock, lock = self._connect_to_bootstrap_server(info)
            with lock:
                sock.send_multipart(frames)
        except zmq.ZMQError as e:
            self.kv_mgr.fail(self.bootstrap_room, f"cannot reach prefill {info.get('rank_ip')}:{info.get('rank_port')}: "
                                                  f"{e}")
            self.conclude_state = KVPoll.Failed
            return False
        return True

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None,
                      decode_prefix_len: int | None = None, destination: Any = None, *_: Any, **__: Any) -> None:
        if getattr(self, "bootstrap_infos", None) is None:
            self.kv_mgr.fail(self.bootstrap_room, f"could not fetch prefill parallel info from {self.bootstrap_addr}")
            return
        if destination is not None and getattr(destination, "name", "DEVICE") != "DEVICE":
            raise NotImplementedError("the pdsdk transfer backend moves KV into device pages only")
        pages = np.ascontiguousarray(kv_indices, dtype=np.int32).tobytes()
        has_state = bool(state_indices) and any(s is not None and len(s) for s in state_indices)
        for info in self.bootstrap_infos:
            dummy = bool(info.get("is_dummy", False))
            msg = wire.TransferRequest(
                room=int(self.bootstrap_room), agent=self.kv_mgr.transport.agent, ip=self.kv_mgr.local_ip,
                port=int(self.kv_mgr.rank_port), kv_indices=b"" if dummy else pages,
                aux_index=None if aux_index is None else int(aux_index),
                required_dst_info_num=int(self.required_dst_info_num), decode_prefix_len=int(decode_prefix_len or 0),
                is_dummy=dummy, has_state=has_state and not dummy)
            if not self._push(info, wire.encode(msg)):
                return
        self.init_time = time.time()

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        status = self.kv_mgr.check_status(self.bootstrap_room)
        if status in _FINAL:
            self.conclude_state = status
        elif status == KVPoll.WaitingForInput and self.init_time is not None:
            timed_out = self._check_waiting_timeout()
            if timed_out is not None:
                return timed_out
        return status

    def failure_exception(self) -> None:
        self.conclude_state = KVPoll.Failed
        self.clear()
        _raise_failure(self)


class PdsdkKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's HTTP bootstrap server as is: prefill ranks register, decode ranks look them up."""
