"""`pdsdk launch` with real vLLM on CPU: 1P1D per transport behind the router, requests through the
official openai client, clean shutdown with no process left; a worker killed during start-up stops the launch."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest
from engine.conftest import MAX_TOKENS, PROMPTS
from engine.launched import launch, processes_using, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]


# `local` also runs the kv_events policy: the launcher wires every worker's KV event stream to the router
POLICIES = {"local": "kv_events"}


@pytest.mark.parametrize("transport", ["nixl", "mooncake", "nccl", "local"])
def test_launch_serves_pd_through_the_router_and_stops_clean(transport, model, baseline, tmp_path):
    openai = pytest.importorskip("openai")
    policy = POLICIES.get(transport, "least_load")
    proc, port = launch(model, transport, tmp_path / "logs", "--policy", policy)
    try:
        wait_for(port, proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        for prompt, expected in zip(PROMPTS[:3], baseline[:3]):
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert out.choices[0].text == expected
        stream = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == baseline[1]
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].message.content is not None
        time.sleep(1.5)
        stats = list((tmp_path / "logs" / "stats").glob("*.json"))
        assert stats, "the decode worker wrote no transfer stats"
        if policy == "kv_events":  # both workers' streams caught up, the prefill's blocks indexed
            seen = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/policies", timeout=5).read())
            streams = [st for role in seen.values() for st in role["streams"].values()]
            assert len(streams) == 2 and all(st["state"] == "exact" for st in streams), seen
            assert seen["prefill"]["index"]["stored"] > 0 and seen["prefill"]["index"]["orphans"] == 0, seen
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    assert code in (0, 130)
    time.sleep(1)
    assert processes_using(model) == [], "processes left behind after shutdown"
    with pytest.raises(ConnectionRefusedError):  # nothing listens on the router's port any more
        socket.create_connection(("127.0.0.1", port), timeout=5)


def test_a_worker_killed_during_launch_stops_everything(model, tmp_path):
    proc, port = launch(model, "nixl", tmp_path / "logs")
    try:
        deadline = time.monotonic() + 120
        victims = []
        while not victims and time.monotonic() < deadline:
            victims = [p for p in processes_using(model)
                       if b"kv_consumer" in Path(f"/proc/{p}/cmdline").read_bytes()]
            time.sleep(0.5)
        assert victims, "decode worker never started"
        os.kill(victims[0], signal.SIGKILL)
        code = proc.wait(180)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "logs-launcher.log").read_text()
    assert code != 0 and "decode-0 exited" in out, out[-2000:]
    time.sleep(1)
    assert processes_using(model) == []
