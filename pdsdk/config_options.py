"""Checks of a plugin's `options` against what its factory takes, before it is built.

A store's options are the keyword parameters of its factory (their annotations, else their
defaults, give the type); a transport's are its OPTIONS (their defaults give the type). Numbers must
be finite and not negative; sizes, durations and thread counts (names ending in _bytes, _mb, _s,
threads) must be positive unless their default is 0. Errors name the field: `store.options.capacity_bytes`.
"""

from __future__ import annotations

import inspect
import math
import reprlib
import typing
from typing import Any

import msgspec

from pdsdk.errors import ConfigError

POSITIVE = ("_bytes", "_mb", "_s", "threads")
_NOT_OPTIONS = ("self", "name", "tiers", "layout")  # given by pdsdk, not by a config's options


def check_options(factory: Any, options: dict[str, Any], field: str) -> None:
    """Raise ConfigError for an option `factory` does not take, or a value of the wrong type or range."""
    params = _transport_options(factory) if hasattr(factory, "OPTIONS") else _parameters(factory)
    if params is None:
        return
    for key, value in options.items():
        where = f"{field}.options.{key}"
        if key not in params:
            valid = ", ".join(sorted(params)) or "none"
            raise ConfigError(where, f"unknown option {reprlib.repr(key)}; valid options here: {valid}")
        kind, default = params[key]
        try:
            msgspec.convert(value, kind)
        except msgspec.ValidationError as e:
            raise ConfigError(where, f"{str(e).split(' - at ')[0]}: {reprlib.repr(value)}") from None
        except TypeError:  # a type msgspec does not know (os.PathLike, a class): the factory checks it
            pass
        _check_number(where, key, value, default)


def _check_number(where: str, key: str, value: Any, default: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if not math.isfinite(value):
        raise ConfigError(where, f"must be a finite number, got {value!r}")
    positive = key.endswith(POSITIVE) and default != 0
    if value < 0 or (positive and value == 0):
        raise ConfigError(where, f"must be {'> 0' if positive else '>= 0'}, got {value!r}")


def _parameters(factory: Any) -> dict[str, tuple[Any, Any]] | None:
    """name -> (type, default) of a factory's keyword parameters; None when it takes **kwargs."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    try:
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except Exception:  # noqa: BLE001 - a name only known to type checkers: the defaults give the types
        hints = {}
    params = {}
    for p in signature.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            return None
        if p.name in _NOT_OPTIONS or p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY):
            continue
        default = None if p.default is p.empty else p.default
        params[p.name] = (hints.get(p.name, _type_of(default)), default)
    return params


def _transport_options(cls: Any) -> dict[str, tuple[Any, Any]]:
    options = {**cls.OPTIONS, **(getattr(cls, "STAGING_OPTIONS", {}) if getattr(cls, "SUPPORTS_STAGING", False) else {})}
    return {k: (_type_of(v), v) for k, v in options.items()}


def _type_of(default: Any) -> Any:
    """The type a default stands for: a float default takes ints too; None takes anything."""
    if default is None:
        return Any
    if isinstance(default, float):
        return float
    return type(default)
