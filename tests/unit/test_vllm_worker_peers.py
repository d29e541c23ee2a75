"""The decode worker's prefill ranks are looked up off vLLM's step: a prefill whose side channel does
not answer (SIGSTOPped, overloaded) never blocks the step, fails its requests after one connect
timeout, and is not asked again within the next one."""

import socket
import time
from types import SimpleNamespace

import pytest

from pdsdk.adapters.vllm.metadata import Receive
from pdsdk.adapters.vllm.peers import Peers
from pdsdk.adapters.vllm.worker import WorkerSide
from pdsdk.config import load_config


@pytest.fixture
def silent_port():
    silent = socket.socket()  # listens, never answers: a SIGSTOPped prefill's side channel
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    yield silent.getsockname()[1]
    silent.close()


def _connect(descriptor):
    raise AssertionError("a silent side channel gives nothing to connect to")


def _until_answered(peers, key, port, connect=_connect, limit_s=5.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        start = time.monotonic()
        entry = peers.get(key, "127.0.0.1", port, connect)
        assert time.monotonic() - start < 0.05  # never blocks the caller
        if entry is not None:
            return entry
        time.sleep(0.02)
    raise AssertionError("no answer and no error within the limit")


def test_a_silent_prefill_fails_once_per_connect_timeout_without_blocking(silent_port):
    peers = Peers(connect_s=0.5)
    key = ("prefill-engine", 0)
    try:
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="did not answer within 0.5s"):
            _until_answered(peers, key, silent_port)
        assert 0.4 < time.monotonic() - start < 5
        for _ in range(20):  # every later request of that prefill fails at once
            with pytest.raises(ConnectionError, match="not asked again"):
                peers.get(key, "127.0.0.1", silent_port, _connect)
        time.sleep(0.6)
        assert peers.get(key, "127.0.0.1", silent_port, _connect) is None  # after the cooldown: asked again
    finally:
        peers.close()


def test_an_answering_prefill_is_connected_once_and_cached():
    asked, connected = [], []

    def fetcher(host, port, rank, timeout_s):
        asked.append(rank)
        return {"descriptor": b"d%d" % rank, "geometry": [[1, 2]], "heads": None}

    peers = Peers(connect_s=0.5, fetcher=fetcher)
    try:
        entry = _until_answered(peers, ("p", 1), 1, connect=connected.append, limit_s=2)
        assert entry[1:] == ([[1, 2]], None)
        for _ in range(5):
            assert peers.get(("p", 1), "h", 1, connected.append) is entry
        assert asked == [1] and connected == [b"d1"]
    finally:
        peers.close()


def test_the_step_returns_at_once_and_the_request_fails_after_the_timeout(silent_port):
    """Through the worker: the load waits off the step, then comes back as a load error for vLLM to
    recompute; the step never took longer than a few milliseconds."""
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1),
                                  kv_transfer_config=SimpleNamespace(get_from_extra_config=lambda key, default=None: default))
    worker = WorkerSide(vllm_config, load_config({"transport": "local", "timeouts": {"connect_s": 0.5}}), "d", 0)
    worker.transport = SimpleNamespace(connect=_connect, close=lambda: None)
    r = Receive([1, 2], [3, 4], "prefill-engine", "req-1", "127.0.0.1", silent_port, 1)
    try:
        start = time.monotonic()
        worker._start_receive("req-1", r)
        assert time.monotonic() - start < 0.05
        deadline = time.monotonic() + 5
        received = None
        while received is None and time.monotonic() < deadline:
            step = time.monotonic()
            _, received = _finished(worker)
            assert time.monotonic() - step < 0.05
            time.sleep(0.02)
        assert received == {"req-1"} and worker.get_block_ids_with_load_errors() == {1, 2}
    finally:
        worker.shutdown()


def _finished(worker):
    worker.transport.notifications = lambda: []
    return worker.get_finished(set())
