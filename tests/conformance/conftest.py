"""Conformance suites run on every registered plugin of their kind, found through the registry.

A new transport, store or policy is picked up with no change here. Plugins that need a server or
options for a test run get them from `options_for` (built-ins add theirs next to their fixtures).
"""

from __future__ import annotations


from pdsdk.plugins import registry

PARAM_FOR_KIND = {"store_name": "store", "transport_name": "transport", "policy_name": "policy"}


def pytest_generate_tests(metafunc):
    for param, kind in PARAM_FOR_KIND.items():
        if param in metafunc.fixturenames:
            # module scope: a module's tests can share one expensive set-up per plugin
            metafunc.parametrize(param, registry().names(kind), scope="module")
