"""Policy specifics, the radix tree, circuit breakers, hints, worker arguments."""

from __future__ import annotations

import time

import pytest

from pdsdk.errors import ConfigError
from pdsdk.router.breaker import CircuitBreaker
from pdsdk.router.http.client_request import BadRequest, route_request
from pdsdk.router.http.hints import parse_hints
from pdsdk.router.policies.base import RouteRequest
from pdsdk.router.policies.prefix import Prefix
from pdsdk.router.policies.prefix_tree import PrefixTree, chunk_keys
from pdsdk.router.policies.session import Session
from pdsdk.router.workers import Worker, parse_worker_arg


def ws(n):
    return [Worker(f"http://10.0.0.{i}:8000") for i in range(n)]


def test_prefix_routes_shared_prefix_to_the_same_worker_until_load_guard():
    p = Prefix(balance_abs=4, balance_rel=1.5)
    w = ws(3)
    system = "You are a helpful assistant. " * 20
    first = p.choose(w, RouteRequest("r0", text=system + "question 0")).worker
    for i in range(1, 5):
        c = p.choose(w, RouteRequest(f"r{i}", text=system + f"question {i}"))
        assert c.worker is first and c.reason.startswith("prefix-hit") and c.cached_tokens > 0
    first.inflight = 10  # overloaded: the guard overrides the cache
    c = p.choose(w, RouteRequest("r9", text=system + "question 9"))
    assert c.worker is not first and c.reason.startswith("load guard")


def test_radix_tree_lru_evicts_leaves_first_and_forgets_workers():
    t = PrefixTree(max_chunks=4)
    keys = chunk_keys("a" * 64 * 3, None, 64, 16)
    t.insert("w", keys)
    assert t.match(keys) == {"w": 3}
    other = chunk_keys("b" * 64 * 2, None, 64, 16)
    t.insert("w", other)  # 5 chunks > 4: the oldest leaf goes, parents stay
    assert t.match(keys) == {"w": 2} and t.size("w") == 4
    t.remove_worker("w")
    assert t.match(keys) == {} and t.match(other) == {}
    assert chunk_keys("", [1, 2, 3], 64, 2) != chunk_keys("\x01\x02\x03", None, 64, 2)


def test_session_affinity_sticky_and_moves_only_when_its_worker_leaves():
    p = Session()
    w = ws(4)
    homes = {s: p.choose(w, RouteRequest("r", session=s)).worker for s in "abcdefgh"}
    assert len(set(homes.values())) > 1
    for s, home in homes.items():
        assert p.choose(w, RouteRequest("r", session=s)).worker is home
    gone = homes["a"]
    p.remove_worker(gone)
    rest = [x for x in w if x is not gone]
    for s, home in homes.items():
        c = p.choose(rest, RouteRequest("r", session=s))
        assert c.worker is home if home is not gone else c.worker in rest
    assert p.choose(w, RouteRequest("r")).reason.startswith("no session")


def test_circuit_breaker_cycle():
    b = CircuitBreaker(threshold=2, cooldown_s=0.05)
    b.record(False)
    assert b.allows()
    b.record(False)
    assert b.state == "open" and not b.allows()
    time.sleep(0.06)
    assert b.allows() and b.state == "half-open"
    b.started()
    assert not b.allows()  # one trial at a time
    b.record(False)
    assert b.state == "open" and b.cooldown == 0.1  # doubled
    time.sleep(0.11)
    assert b.allows()
    b.started()
    b.record(True)
    assert b.state == "closed" and b.cooldown == 0.05


def test_hints_from_body_dynamo_and_headers():
    body = {"nvext": {"agent_hints": {"priority": 2, "prefix_id": "agent-7", "osl": 100}},
            "pdsdk": {"ttl_s": "30", "pin": True}}
    assert parse_hints(body, {}) == {"priority": 2, "session": "agent-7", "ttl_s": 30.0, "pin": True}
    assert parse_hints(body, {"x-pdsdk-session": "h", "x-pdsdk-keep": "false"})["session"] == "h"
    assert parse_hints({}, {"x-pdsdk-keep": "no"}) == {"keep": False}
    with pytest.raises(Exception):
        parse_hints({"pdsdk": {"priority": "high"}}, {})
    r = route_request({"prompt": [1, 2, 3], "pdsdk": {"session": "s"}}, {}, "completions")
    assert r.token_ids == [1, 2, 3] and r.session == "s"
    with pytest.raises(BadRequest):
        route_request({"prompt": [1, "x"]}, {}, "completions")


def test_worker_arguments():
    w = parse_worker_arg("http://[::1]:30000 8998", "prefill")
    assert (w.url, w.bootstrap_port, w.host) == ("http://[::1]:30000", 8998, "::1")
    assert parse_worker_arg("http://p:1,none", "prefill").bootstrap_port is None
    with pytest.raises(ConfigError):
        parse_worker_arg("p:1", "decode")
    with pytest.raises(ConfigError):
        Worker("http://p:1", role="boss")
