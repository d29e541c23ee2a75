"""The router policy contract (pdsdk.router.policies), run against every registered policy.

A policy ranks the candidates the router gives it: it must pick one of them, say why, survive
workers coming and going, spread distinct requests over idle workers, and be quick."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from helpers import need_plugin
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdsdk.plugins import registry
from pdsdk.router.policies import Choice, NoWorker, Policy, RouteRequest


@dataclass(eq=False)
class W:
    url: str
    role: str = "plain"
    kv_events: str | None = None
    kv_replay: str | None = None
    inflight: int = 0

    @property
    def load(self) -> int:
        return self.inflight


@pytest.fixture
def make(policy_name):
    spec = registry().get("policy", policy_name)
    need_plugin(spec)
    made: list[Policy] = []

    def build(workers=()):
        p = spec.load()(name=policy_name)
        for w in workers:
            p.add_worker(w)
        made.append(p)
        return p

    yield build
    for p in made:
        p.close()


def workers(n):
    return [W(f"http://10.0.0.{i}:8000") for i in range(n)]


def req(i, text=None, tokens=None, session=None):
    return RouteRequest(request_id=f"r{i}", model="m", text=text if text is not None else f"prompt {i} " * 8,
                        token_ids=tokens, session=session)


def test_is_a_policy_with_a_name(make, policy_name):
    p = make()
    assert isinstance(p, Policy) and p.name == policy_name
    assert isinstance(p.stats(), dict)


def test_unknown_option_is_an_error(policy_name):
    spec = registry().get("policy", policy_name)
    need_plugin(spec)
    with pytest.raises(TypeError):
        spec.load()(name=policy_name, no_such_option=1)


def test_no_candidates_raises_noworker(make):
    with pytest.raises(NoWorker):
        make().choose([], req(0))


def test_single_candidate_is_chosen(make):
    ws = workers(3)
    p = make(ws)
    for i in range(5):
        c = p.choose([ws[1]], req(i))
        assert isinstance(c, Choice) and c.worker is ws[1] and c.reason


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # `make` builds a fresh policy per call
@given(n=st.integers(1, 6), mask=st.integers(1, 63), texts=st.lists(st.text(max_size=300), min_size=1, max_size=5),
       session=st.one_of(st.none(), st.sampled_from(["a", "b"])), tokens=st.booleans())
def test_always_picks_a_candidate(make, n, mask, texts, session, tokens):
    ws = workers(n)
    p = make(ws)
    cands = [w for i, w in enumerate(ws) if mask >> i & 1] or ws[:1]
    for i, t in enumerate(texts):
        r = req(i, text=t, tokens=[ord(c) for c in t] if tokens else None, session=session)
        c = p.choose(cands, r)
        assert c.worker in cands and isinstance(c.reason, str) and c.reason
        assert 0 <= c.cached_tokens <= max(r.prompt_tokens, 1) * 4
        assert p.cached_tokens(c.worker, r) >= 0
        p.on_start(c.worker, r)
        p.on_finish(c.worker, r, ok=True)


def test_spreads_distinct_requests(make):
    """200 distinct prompts/sessions over 4 idle workers: none may be starved or flooded."""
    ws = workers(4)
    p = make(ws)
    counts = dict.fromkeys((w.url for w in ws), 0)
    for i in range(200):
        r = req(i, text=f"{i} distinct prompt " * 10, session=f"s{i}")
        c = p.choose(ws, r)
        c.worker.inflight += 1
        p.on_start(c.worker, r)
        counts[c.worker.url] += 1
        if i % 3 == 0:  # some finish, some stay in flight
            c.worker.inflight -= 1
            p.on_finish(c.worker, r, ok=True)
    assert min(counts.values()) >= 10, counts


def test_survives_workers_leaving_and_joining(make):
    ws = workers(4)
    p = make(ws)
    for i in range(20):
        p.choose(ws, req(i % 5, session=f"s{i % 5}"))
    p.remove_worker(ws[0])
    left = ws[1:]
    for i in range(20):
        assert p.choose(left, req(i % 5, session=f"s{i % 5}")).worker in left
    newcomer = W("http://10.0.0.99:8000")
    p.add_worker(newcomer)
    for i in range(20):
        assert p.choose(left + [newcomer], req(i, session=f"s{i}")).worker in left + [newcomer]


def test_choose_is_quick(make):
    ws = workers(16)
    p = make(ws)
    text = "a long shared system prompt " * 100
    start = time.perf_counter()
    for i in range(300):
        p.choose(ws, req(i, text=text + str(i), tokens=list(range(i, i + 2000)), session=f"s{i % 50}"))
    per = (time.perf_counter() - start) / 300
    assert per < 5e-3, f"{per * 1e3:.2f} ms per choose"
