"""Fixtures of the KV event tests: fake engines' event streams, and either index implementation."""

from __future__ import annotations

import pytest
from kvevents import endpoints
from pdsdk.testing import fake_kv_events as fe


@pytest.fixture
def stream_env():
    """make(replay=True, ep=None) -> (a fake engine's event Publisher, its endpoints); all closed after."""
    made = []

    def make(replay=True, ep=None):
        ep = ep or endpoints()
        pub = fe.Publisher(ep[0], ep[1] if replay else None)
        made.append(pub)
        return pub, ep

    yield make
    for p in made:
        p.close()


@pytest.fixture(params=["compiled", "python"])
def keys_by(request, monkeypatch):
    """The index's `chain`, with the compiled index and then with its Python twin in charge."""
    from pdsdk.router import kvindex

    if request.param == "python":
        monkeypatch.setattr(kvindex, "_compiled", None)
    elif kvindex._compiled is None:
        pytest.skip("pdsdk was installed without its compiled index (no C compiler)")
    return kvindex.chain
