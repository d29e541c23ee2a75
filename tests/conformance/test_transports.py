"""The L2 transport contract, run against every registered transport (filled by the transports work)."""

from helpers import need_plugin

from pdsdk.plugins import registry


def test_registered_with_extra_and_loadability(transport_name):
    spec = registry().get("transport", transport_name)
    need_plugin(spec)
    assert spec.load() is not None
