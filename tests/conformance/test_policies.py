"""The router policy contract, run against every registered policy (filled by the router work)."""

from helpers import need_plugin

from pdsdk.plugins import registry


def test_policy_loads(policy_name):
    spec = registry().get("policy", policy_name)
    need_plugin(spec)
    assert spec.load() is not None
