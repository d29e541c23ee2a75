"""pdsdk: pluggable parts for prefill/decode disaggregated serving on vLLM and SGLang.

`import pdsdk` imports no engine and no transport library; see DESIGN.md for the layers.
"""

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
