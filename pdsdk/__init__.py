"""pdsdk: pluggable parts for prefill/decode disaggregated serving on vLLM and SGLang.

`import pdsdk` imports no engine and no transport library; docs/architecture.md draws the layers.
"""

import os as _os

# Installed, the layer folders sit inside pdsdk/ (pyproject.toml maps them in); in a source checkout they
# sit beside it: let pdsdk.router, pdsdk.connectors, ... resolve there too.
_root = _os.path.dirname(_os.path.dirname(__file__))
if not _os.path.isdir(_os.path.join(__path__[0], "router")) and _os.path.isfile(_os.path.join(_root, "pyproject.toml")):
    __path__.append(_root)

from pdsdk._version import __version__
from pdsdk.errors import ConfigError, LayoutMismatch, MissingDependency, PdsdkError
from pdsdk.hookspecs import hookimpl

_LAZY = {"KVLayout", "Region", "Span"}  # pdsdk.kv loads numpy (and its BLAS threads): not in the router


def __getattr__(name: str):
    if name in _LAZY:
        from pdsdk import kv

        return getattr(kv, name)
    raise AttributeError(f"module 'pdsdk' has no attribute {name!r}")


__all__ = [
    "__version__", "hookimpl", "KVLayout", "Region", "Span",
    "PdsdkError", "ConfigError", "MissingDependency", "LayoutMismatch",
]
