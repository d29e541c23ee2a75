"""One side of an SGLang PD transfer, in its own process, driven the way SGLang's scheduler drives
a transfer backend (disaggregation/prefill.py and decode.py), with no model and no scheduler.

KV memory is SGLang's own: a real MHATokenToKVPool on CPU and real MetadataBuffers, described to
the manager by a KVArgs filled like disaggregation/prefill.py and decode.py fill it. The prefill
side also runs the real bootstrap server (as SGLang runs it in the prefill server's process).
Progress and the result go to stdout as JSON lines; the test compares the two sides' digests.

  python pd_worker.py --role prefill|decode --bootstrap-port P --room R [--hang]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np
import torch

LAYERS, HEADS, HEAD_DIM, PAGE, TOKENS = 3, 2, 32, 16, 1024  # 2 KiB K/V pages, 64 pages per buffer
PAGES = 12  # the request's pages
POLL_TIMEOUT_S = float(os.environ.get("PD_WORKER_TIMEOUT_S", "60"))
_out = sys.stdout


def emit(**event) -> None:
    _out.write(json.dumps(event) + "\n")
    _out.flush()


def known_args(fn, *args, **kwargs):
    """Call `fn` with the keyword arguments this SGLang version knows (0.5.15 and 0.5.23 differ)."""
    import inspect

    params = inspect.signature(fn).parameters
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


def build(role: str, port: int, heads: int = HEADS):
    from sglang.srt.plugins import load_plugins

    load_plugins()  # what launch_server and every scheduler process do first
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode, KVClassType, MetadataBuffers, TransferBackend, get_kv_class, setup_state_kv_args,
    )
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.server_args import ServerArgs

    from pdsdk.compat import sglang as compat

    server_args = ServerArgs(model_path="dummy", disaggregation_mode=role, disaggregation_transfer_backend="pdsdk",
                             host="127.0.0.1", disaggregation_bootstrap_port=port, device="cpu")
    compat.publish_standalone(server_args)
    backend = TransferBackend("pdsdk")
    server = None
    if role == "prefill":
        server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    pool = MHATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=heads, head_dim=HEAD_DIM,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    meta = known_args(MetadataBuffers, 8, hidden_size=64, hidden_states_dtype=torch.bfloat16,
                      max_sampling_mask_tokens=0)  # a 0.5.23 argument
    kv_args = get_kv_class(backend, KVClassType.KVARGS)()
    kv_args.engine_rank, kv_args.pp_rank, kv_args.system_dp_rank, kv_args.rust_http_port = 0, 0, 0, None
    kv_args.kv_cache_dtype_str, kv_args.kv_layout = "bfloat16", None
    kv_args.prefill_start_layer, kv_args.prefill_end_layer = 0, LAYERS
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = pool.get_contiguous_buf_infos()
    kv_args.num_draft_entries, kv_args.kv_layer_ids = 0, list(range(LAYERS)) * 2
    kv_args.kv_head_num, kv_args.total_kv_head_num, kv_args.page_size = heads, heads, PAGE
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = meta.get_buf_infos()
    kv_args.ib_device, kv_args.gpu_id = None, None
    setup_state_kv_args(kv_args, pool, None, LAYERS)
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    manager = get_kv_class(backend, KVClassType.MANAGER)(kv_args, mode, server_args, False)
    return backend, server, pool, meta, kv_args, manager


def digest(kv_args, pages, slot: int) -> str:
    """sha256 over the given pages of every KV buffer, then the metadata row of every aux buffer."""
    from pdsdk.connectors.transports.common.buffers import host_array

    h = hashlib.sha256()
    for ptr, item in zip(kv_args.kv_data_ptrs, kv_args.kv_item_lens):
        for p in pages:
            h.update(host_array(ptr + int(p) * item, item).tobytes())
    for ptr, item in zip(kv_args.aux_data_ptrs, kv_args.aux_item_lens):
        h.update(host_array(ptr + slot * item, item).tobytes())
    return h.hexdigest()


def wait_for(poller, wanted, timeout: float = POLL_TIMEOUT_S) -> int:
    """Poll like the scheduler's event loop (every few ms) until a wanted or final state."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    end = time.monotonic() + timeout
    while True:
        state = poller.poll()
        if state in wanted or state == KVPoll.Failed or time.monotonic() > end:
            return state
        time.sleep(0.005)


def failure_reason(poller) -> str:
    try:
        poller.failure_exception()
    except Exception as e:  # noqa: BLE001 - failure_exception raises by contract
        return f"{type(e).__name__}: {e}"
    return "failure_exception() did not raise"


def run_prefill(args) -> None:
    backend, server, pool, meta, kv_args, manager = build("prefill", args.bootstrap_port, args.heads)
    rng = np.random.default_rng(args.seed)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.view(torch.uint8).copy_(torch.from_numpy(rng.integers(0, 256, tuple(buf.view(torch.uint8).shape),
                                                                  dtype=np.uint8)))
    slot = 3
    for name in ("output_ids", "cached_tokens", "output_token_logprobs_val"):
        getattr(meta, name)[slot].copy_(torch.from_numpy(rng.integers(0, 99, getattr(meta, name)[slot].shape))
                                        .to(getattr(meta, name).dtype))
    meta.bootstrap_room[slot, 0] = args.room  # the decode side's "metadata landed" gate reads this
    pages = rng.choice(np.arange(1, TOKENS // PAGE), PAGES, replace=False).astype(np.int32)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, get_kv_class

    if args.hostile:  # what any process that can reach the control socket may send
        import zmq

        from pdsdk.adapters.sglang import wire

        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{manager.rank_port}")
        for frames in ([wire.ABORT_TAG, b"not a room"], [wire.TAG, b"\xc1 not msgpack"], [b"junk"]):
            push.send_multipart(frames)
        deadline = time.monotonic() + 10
        while manager._refuse.count < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        emit(event="refused", count=manager._refuse.count)
    emit(event="ready", pid=os.getpid())
    from pdsdk.compat import sglang as compat

    # What prefill.py passes after the room: 0.5.15 (dest_tp_ranks, pp_rank), 0.5.22+ nothing required.
    extra = ([0], 0) if compat.sender_init_params()[:1] == ("dest_tp_ranks",) else ()
    sender = get_kv_class(backend, KVClassType.SENDER)(manager, f"127.0.0.1:{args.bootstrap_port}", args.room,
                                                       *extra)
    state = wait_for(sender, (KVPoll.WaitingForInput,))
    if state != KVPoll.WaitingForInput:
        emit(event="done", state=int(state), reason=failure_reason(sender))
        return
    emit(event="bootstrapped", decode_prefix_len=sender.pop_decode_prefix_len())
    if args.hang:
        emit(event="hanging")
        time.sleep(3600)
    if args.delay_send:
        emit(event="delaying")
        time.sleep(args.delay_send)
    sender.init(PAGES, aux_index=slot)
    start = time.perf_counter()
    for chunk in np.array_split(pages, 3):  # chunked prefill: one send per chunk, the last carries aux
        sender.send(chunk)
        sender.poll()
    state = wait_for(sender, (KVPoll.Success,))
    seconds = time.perf_counter() - start
    result = {"state": int(state), "seconds": seconds, "digest": digest(kv_args, pages, slot),
              "bytes": sender.get_transfer_metric().transfer_total_bytes, "path": manager.transport.path()}
    if state != KVPoll.Success:
        result["reason"] = failure_reason(sender)
    else:
        sender.clear()
    emit(event="done", **result)
    sys.stdin.readline()  # keep the bootstrap server up until the test is done with decode
    manager.teardown()


def run_decode(args) -> None:
    backend, _, pool, meta, kv_args, manager = build("decode", args.bootstrap_port, args.heads)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, get_kv_class

    addr = f"127.0.0.1:{args.bootstrap_port}"
    receiver = get_kv_class(backend, KVClassType.RECEIVER)(manager, addr, args.room)
    end = time.monotonic() + POLL_TIMEOUT_S
    while not manager.try_ensure_parallel_info(addr):  # the prefill registers with its bootstrap server
        if time.monotonic() > end:
            emit(event="done", state=0, reason="prefill never registered")
            return
        time.sleep(0.2)
    receiver.init(0)
    state = wait_for(receiver, (KVPoll.WaitingForInput,))
    if state != KVPoll.WaitingForInput:
        emit(event="done", state=int(state), reason=failure_reason(receiver))
        return
    pages = np.random.default_rng(args.seed + 1).choice(np.arange(1, TOKENS // PAGE), PAGES,
                                                        replace=False).astype(np.int32)
    slot = 5
    receiver.send_metadata(pages, slot, None)
    emit(event="metadata_sent")
    start = time.monotonic()
    state = wait_for(receiver, (KVPoll.Success,), timeout=args.timeout)
    result = {"state": int(state), "seconds": time.monotonic() - start}
    if state == KVPoll.Success:
        result.update(digest=digest(kv_args, pages, slot), room_landed=int(meta.bootstrap_room[slot, 0]))
        receiver.clear()
    else:
        result["reason"] = failure_reason(receiver)
    emit(event="done", **result)
    manager.teardown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--bootstrap-port", type=int, required=True)
    p.add_argument("--room", type=int, required=True)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--hang", action="store_true", help="prefill: stop after bootstrap, never send")
    p.add_argument("--hostile", action="store_true", help="prefill: first send junk to its own control socket")
    p.add_argument("--delay-send", type=float, default=0, help="prefill: wait this long before sending")
    p.add_argument("--heads", type=int, default=HEADS, help="KV heads (a different value on one side: mismatch)")
    p.add_argument("--timeout", type=float, default=POLL_TIMEOUT_S, help="decode: wait this long for the transfer")
    args = p.parse_args()
    # Keep the protocol on a private copy of stdout: libraries (NIXL) log to stdout.
    global _out
    _out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    (run_prefill if args.role == "prefill" else run_decode)(args)
    os._exit(0)  # skip interpreter teardown: SGLang's and the transports' daemon threads are not ours


if __name__ == "__main__":
    main()
