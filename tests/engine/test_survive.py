"""A launched service survives its workers (issue 23's reproduction, real vLLM on CPU): `pdsdk launch`
1P2D over nixl, 30 streaming completions 0.5 s apart, SIGKILL of one process group after the 10th.
No request fails before its first token, a stream cut on the killed worker ends with an error event,
the next 10 requests all succeed (the killed process may still be down), and the killed process is
back at its first restart and serving. Once for a decode worker, the prefill worker and the router,
on one launched service; how long each took to come back is printed (`-s`)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine.conftest import MAX_TOKENS, PROMPTS
from engine.launched import launch, processes_using, wait_for
from helpers import eventually

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1800)]
PROMPT = PROMPTS[2]  # several pages: the decode worker pulls them from the prefill's
START_TIMEOUT_S = 600  # the launcher restarts a worker again if it is not healthy by then


@dataclass
class Service:
    port: int
    log_dir: Path
    start_s: float  # launch to ready: every engine's first start, at once

    def status(self) -> dict:
        return json.loads((self.log_dir / "status.json").read_text())["processes"]

    def client(self, retries: int = 0):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=retries,
                             timeout=300)

    def kill(self, name: str) -> float:
        os.killpg(self.status()[name]["pid"], signal.SIGKILL)
        return time.monotonic()

    def back_after(self, name: str, killed: float, restarts: int) -> float:
        """Seconds from the kill until the launcher reports `name` healthy after its restart: the first
        restart (restarts: the count before the kill + 1), within the start timeout it has."""
        def back() -> bool:
            st = self.status()[name]
            assert st["restarts"] <= restarts, f"{name}'s restart failed: {st}"
            return st["restarts"] == restarts and st["state"] == "healthy"
        assert eventually(back, timeout=START_TIMEOUT_S, interval=1), self.status()
        return time.monotonic() - killed

    def served_by(self, name: str) -> float:
        """Requests the (restarted) vLLM worker `name` finished: from its own /metrics."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.status()[name]['port']}/metrics", timeout=10).read()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
                   if line.startswith("vllm:request_success_total"))


@pytest.fixture(scope="module")
def service(model, tmp_path_factory):
    pytest.importorskip("openai")
    log_dir = tmp_path_factory.mktemp("survive") / "logs"
    t0 = time.monotonic()
    proc, port = launch(model, "nixl", log_dir, "--prefill", "1", "--decode", "2", "--max-restarts", "3",
                        "--start-timeout", str(START_TIMEOUT_S))
    try:
        wait_for(port, proc, 900)
        yield Service(port, log_dir, time.monotonic() - t0)
        assert proc.poll() is None, "the launcher stopped"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    time.sleep(1)
    assert processes_using(model) == [], "processes left behind after shutdown"


def stream(client) -> tuple[str, int, str]:
    """(outcome, text, error): ok, cut (an error after some tokens) or failed (before the first)."""
    chunks, error = [], ""
    try:
        for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True):
            chunks.append(chunk.choices[0].text if chunk.choices else "")
    except Exception as e:  # noqa: BLE001 - classified
        error = f"{type(e).__name__}: {e}"
    return ("cut" if chunks else "failed") if error else "ok", "".join(chunks), error


def load_with_a_kill(service: Service, victim: str, client, n: int = 30, kill_after: int = 10) -> tuple[list, float]:
    with ThreadPoolExecutor(n) as pool:
        futures, killed = [], 0.0
        for i in range(n):
            futures.append(pool.submit(stream, client))
            if i + 1 == kill_after:
                killed = service.kill(victim)
            time.sleep(0.5)
        return [f.result() for f in futures], killed


def check_kill(service: Service, victim: str, retries: int = 0) -> None:
    client = service.client(retries)
    reference = stream(client)
    assert reference[0] == "ok", reference
    before = service.status()[victim]["restarts"]
    results, killed = load_with_a_kill(service, victim, client)
    failed = [r for r in results if r[0] == "failed"]
    assert not failed, f"{len(failed)} of {len(results)} failed before their first token: {failed[:3]}"
    for outcome, text, error in results:
        if outcome == "cut":  # a clear error event, not a silent end
            assert "worker failed mid-stream" in error or victim == "router", error
        else:
            assert text == reference[1], (text, reference[1])
    after = [stream(client) for _ in range(10)]  # the victim may still be down: routed around
    assert all(r == reference for r in after), after
    took = service.back_after(victim, killed, before + 1)
    print(f"{victim}: {sum(r[0] == 'cut' for r in results)} of {len(results)} cut mid-stream, back {took:.0f} s "
          f"after the kill (the first start of all three engines at once: {service.start_s:.0f} s)")
    with ThreadPoolExecutor(2) as pool:  # two at a time: least_load spreads them over both decode workers
        again = list(pool.map(lambda _: stream(client), range(10)))
    assert all(r == reference for r in again), again
    out = (service.log_dir.parent / f"{service.log_dir.name}-launcher.log").read_text()
    assert f"restart: {victim} ({service.status()[victim]['role']}, port" in out, out[-2000:]


def test_a_killed_decode_worker_is_routed_around_then_back(service):
    check_kill(service, "decode-0")
    # Healthy again means traffic again once the router's health check has seen it (every few seconds).
    client, deadline = service.client(0), time.monotonic() + 60
    while service.served_by("decode-0") == 0 and time.monotonic() < deadline:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda _: stream(client), range(4)))
    assert service.served_by("decode-0") > 0


def test_a_killed_prefill_worker_is_routed_around_then_back(service):
    check_kill(service, "prefill-0")
    for _ in range(20):  # the router sees it healthy at its next check (every 5 s): PD again
        if service.served_by("prefill-0") > 0:
            break
        assert stream(service.client())[0] == "ok"
        time.sleep(1)
    assert service.served_by("prefill-0") > 0


def test_a_killed_router_is_restarted_on_the_held_socket(service):
    # Requests inside the router when it dies are retried by the client (the OpenAI client does twice
    # by default); new connections wait in the launcher's listening socket until the new router takes them.
    check_kill(service, "router", retries=2)
