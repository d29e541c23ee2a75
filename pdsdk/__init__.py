"""pdsdk: pluggable parts for prefill/decode disaggregated serving on vLLM and SGLang.

`import pdsdk` imports no engine and no transport library; see DESIGN.md for the layers.
"""

from pdsdk._version import __version__
from pdsdk.errors import ConfigError, LayoutMismatch, MissingDependency, PdsdkError
from pdsdk.hookspecs import hookimpl
from pdsdk.kv import KVLayout, Region, Span

__all__ = [
    "__version__", "hookimpl", "KVLayout", "Region", "Span",
    "PdsdkError", "ConfigError", "MissingDependency", "LayoutMismatch",
]
