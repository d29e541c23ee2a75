"""Errors pdsdk raises. Each message names what was wrong and how to fix it."""

from __future__ import annotations


class PdsdkError(Exception):
    """Base of every error pdsdk raises on purpose."""


class ConfigError(PdsdkError, ValueError):
    """A configuration value is wrong: names the field, the bad value and the valid choices."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class MissingDependency(PdsdkError, ImportError):
    """An optional library that a chosen plugin needs is not installed."""

    def __init__(self, what: str, extra: str | None, cause: BaseException | None = None):
        hint = f'pip install "pdsdk[{extra}]"' if extra else "install the package that provides it"
        detail = f" ({cause})" if cause else ""
        super().__init__(f"{what} needs an optional dependency that is not available{detail}; fix: {hint}")
        self.extra = extra


class LayoutMismatch(PdsdkError):
    """Two peers describe their KV caches differently; names every differing field."""

    def __init__(self, differences: dict[str, tuple[object, object]]):
        self.differences = differences
        parts = ", ".join(f"{k}: local={a!r} remote={b!r}" for k, a, b in
                          ((k, *v) for k, v in differences.items()))
        super().__init__(f"KV layout mismatch between peers ({parts}); "
                         "start prefill and decode with the same model, dtype, page size and compatible TP")


class TransportError(PdsdkError):
    """A transport cannot do what was asked (bad descriptor, closed transport, wrong peer)."""
