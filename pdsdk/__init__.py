"""pdsdk: pluggable parts for prefill/decode disaggregated serving on vLLM and SGLang.

The public API is what this module exports: the plugin marker (`hookimpl`), the base classes a plugin
implements (`Transport`, `Store`, `Policy`), and the factories that build parts from a config
(`load_config`, `open_transport`, `open_store`). `import pdsdk` imports no engine, no transport
library and not numpy: names whose modules need them load on first use. docs/architecture.md draws
the layers.
"""

import os as _os

# Installed, the layer folders sit inside pdsdk/ (pyproject.toml maps them in); in a source checkout they
# sit beside it: let pdsdk.router, pdsdk.connectors, ... resolve there too.
_root = _os.path.dirname(_os.path.dirname(__file__))
if not _os.path.isdir(_os.path.join(__path__[0], "router")) and _os.path.isfile(_os.path.join(_root, "pyproject.toml")):
    __path__.append(_root)

from pdsdk._version import __version__
from pdsdk.errors import ConfigError, LayoutMismatch, MissingDependency, PdsdkError, TransportError
from pdsdk.hookspecs import hookimpl

# name -> module that defines it, imported on first use (pdsdk.kv and the transports load numpy).
_LAZY = {
    "load_config": "pdsdk.config",
    "KVLayout": "pdsdk.kv", "Region": "pdsdk.kv", "Span": "pdsdk.kv",
    "Transport": "pdsdk.connectors.transports.base",
    "TransferStatus": "pdsdk.connectors.transports.common.status",
    "open_transport": "pdsdk.connectors.transports.factory",
    "Store": "pdsdk.connectors.stores.base", "Hints": "pdsdk.connectors.stores.base",
    "open_store": "pdsdk.connectors.stores.factory",
    "Policy": "pdsdk.router.policies",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pdsdk' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


__all__ = [
    "__version__", "hookimpl", *_LAZY,
    "PdsdkError", "ConfigError", "MissingDependency", "LayoutMismatch", "TransportError",
]
