"""Build a transport from its config: a registered name, {"name", "options"}, or a TransportSpec."""

from __future__ import annotations

from typing import Any

from pdsdk.connectors.transports.base import Transport
from pdsdk.kv import KVLayout


def open_transport(spec: Any, *, layout: KVLayout, host: str = "127.0.0.1", transfer_timeout_s: float = 30.0,
                   connect_timeout_s: float = 10.0, **options: Any) -> Transport:
    """A transport for `spec`, its options checked (a ConfigError names the bad one) and `options` added
    to them. `host`: the address peers reach this side at; the timeouts bound a transfer and a connect."""
    from pdsdk.config import TransportSpec, load_config
    from pdsdk.config_options import check_options
    from pdsdk.errors import ConfigError
    from pdsdk.plugins import registry

    if not isinstance(spec, TransportSpec):
        spec = load_config({"transport": spec, "store": None}, check_plugins=False).transport
        if spec is None:
            raise ConfigError("transport", "no transport named")
    options = {**spec.options, **options}
    cls = registry().load("transport", spec.name)
    check_options(cls, options, "transport")
    return cls(name=spec.name, layout=layout, host=host, transfer_timeout_s=transfer_timeout_s,
               connect_timeout_s=connect_timeout_s, **options)
