"""The decode worker's peer cache: a prefill that does not answer costs one connect timeout, not one
per request (the lookup runs inside vLLM's step)."""

import socket
import time
from types import SimpleNamespace

from pdsdk.adapters.vllm.metadata import Receive
from pdsdk.adapters.vllm.worker import WorkerSide
from pdsdk.config import load_config


def test_a_silent_prefill_is_not_asked_again_within_the_connect_timeout():
    silent = socket.socket()  # listens, never answers: a SIGSTOPped prefill's side channel
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
    worker = WorkerSide(vllm_config, load_config({"transport": "local", "timeouts": {"connect_s": 0.5}}), "d", 0)
    r = Receive([1], [1], "prefill-engine", "req-1", "127.0.0.1", port, 1)
    try:
        start = time.monotonic()
        try:
            worker._peer(r, 0)
            raise AssertionError("a silent side channel must fail")
        except ConnectionError as e:
            assert "did not answer within 0.5s" in str(e)
        assert 0.4 < time.monotonic() - start < 5
        for _ in range(20):  # every later request of that prefill fails at once
            start = time.monotonic()
            try:
                worker._peer(r, 0)
            except ConnectionError as e:
                assert "not retried for another" in str(e)
            assert time.monotonic() - start < 0.05
        time.sleep(0.6)
        start = time.monotonic()
        try:
            worker._peer(r, 0)
        except ConnectionError:
            pass
        assert time.monotonic() - start > 0.4  # after the cooldown it is asked again
    finally:
        silent.close()
