"""Build a store from its config: a name, {"name", "options"}, {"tiered": [...]}, or a StoreSpec."""

from __future__ import annotations

from typing import Any

from pdsdk.connectors.stores.base import Store


def open_store(spec: Any) -> Store:
    """A Store instance for `spec` (an instance is returned as is)."""
    if isinstance(spec, Store):
        return spec
    from pdsdk.config import StoreSpec, load_config
    from pdsdk.config_options import check_options
    from pdsdk.plugins import registry

    if not isinstance(spec, StoreSpec):
        spec = load_config({"store": spec, "transport": None}, check_plugins=False).store
    cls = registry().load("store", spec.name)
    check_options(cls, spec.options, "store")
    if spec.tiers:
        return cls(name=spec.name, tiers=list(spec.tiers), **spec.options)
    return cls(name=spec.name, **spec.options)
