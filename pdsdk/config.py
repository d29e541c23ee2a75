"""The connector config shared by vLLM's `kv_connector_extra_config`, SGLang (`PDSDK_CONFIG`)
and the CLI.

Accepted forms: a dict, a JSON string, or `@path` to a JSON, YAML or TOML file. Shorthands:
``"transport": "nixl"`` or ``{"name": "nixl", "options": {...}}``; ``"store": "memory"``,
``{"name": "redis", "options": {...}}``, ``{"tiered": ["memory", "disk"]}`` or ``null``.
Errors name the field, the bad value and the valid choices. Text and files are read as hostile
input (config_files.py); plugin options are checked against what the plugin takes (config_options.py).
"""

from __future__ import annotations

import hashlib
import re
import reprlib
import typing
from typing import Annotated, Any

import msgspec

from pdsdk.config_files import check_depth, parse_json, read_file
from pdsdk.config_options import check_options
from pdsdk.errors import ConfigError

FAILURE_POLICIES = ("recompute", "fail")
_NONE = (None, "none", "")
# A duration: positive and finite (NaN fails `gt`, Infinity and 1e999 fail `le`); at most ~31 years.
Seconds = Annotated[float, msgspec.Meta(gt=0, le=1e9)]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class TransportSpec(_Strict):
    name: str
    options: dict[str, Any] = {}


class StoreSpec(_Strict):
    name: str
    options: dict[str, Any] = {}
    tiers: list[StoreSpec] = []  # only for name == "tiered": fastest first


class Timeouts(_Strict):
    connect_s: Seconds = 10.0  # handshake with a new peer
    transfer_s: Seconds = 30.0  # one transfer, post to completion; past it the transfer fails
    lease_s: Seconds = 120.0  # how long prefill keeps pages for a decode that has not read them


class Retention(_Strict):
    """Default L6 hints for pages this worker stores; requests may override them."""

    priority: Annotated[int, msgspec.Meta(ge=-32768, le=32767)] = 0  # higher survives longer under pressure
    ttl_s: Seconds | None = None  # None: until evicted
    pin: bool = False  # pinned pages survive pressure until ttl_s ends


class PdsdkConfig(_Strict):
    transport: TransportSpec | None = msgspec.field(default_factory=lambda: TransportSpec(name="nixl"))
    store: StoreSpec | None = None
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    failure_policy: str = "recompute"  # what a failed KV load does: recompute locally, or fail the request
    retention: Retention = msgspec.field(default_factory=Retention)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def fingerprint(self) -> str:
        canonical = msgspec.json.encode(self.to_dict(), order="sorted")
        return hashlib.sha256(canonical).hexdigest()[:16]


def load_config(source: str | dict | PdsdkConfig | None = None, *, check_plugins: bool = True) -> PdsdkConfig:
    """Parse and validate a config from any accepted form; raises ConfigError."""
    if isinstance(source, PdsdkConfig):
        raw: Any = source.to_dict()
    elif source is None:
        raw = {}
    elif isinstance(source, dict):
        raw = source
    elif isinstance(source, str):
        raw = read_file(source[1:]) if source.startswith("@") else parse_json(source, "config")
    else:
        raise ConfigError("config", f"expected a dict, a JSON string or @path, got {type(source).__name__}")
    check_depth(raw, "config")
    if not isinstance(raw, dict):
        raise ConfigError("config", f"must be an object (mapping), got {type(raw).__name__}")
    raw = dict(raw)
    if "transport" in raw:
        raw["transport"] = _expand_plugin(raw["transport"], "transport")
    if "store" in raw:
        raw["store"] = _expand_store(raw["store"], "store")
    try:
        cfg = msgspec.convert(raw, PdsdkConfig)
    except msgspec.ValidationError as e:
        raise _translate(e, raw) from None
    _check(cfg, check_plugins)
    return cfg


def _expand_plugin(value: Any, field: str) -> Any:
    if value in _NONE:
        return None
    return {"name": value} if isinstance(value, str) else value


def _expand_store(value: Any, field: str) -> Any:
    value = _expand_plugin(value, field)
    if isinstance(value, dict) and "tiered" in value:
        tiers = value["tiered"]
        if not isinstance(tiers, list) or not tiers:
            raise ConfigError(f"{field}.tiered", f"must be a non-empty list of stores, got {reprlib.repr(tiers)}")
        rest = {k: v for k, v in value.items() if k != "tiered"}
        if set(rest) - {"options"}:
            raise ConfigError(field, f"a tiered store takes only 'tiered' and 'options', got {sorted(rest)}")
        return {"name": "tiered", "options": rest.get("options", {}),
                "tiers": [_expand_store(t, f"{field}.tiered[{i}]") for i, t in enumerate(tiers)]}
    return value


def _translate(e: msgspec.ValidationError, raw: dict) -> ConfigError:
    """Turn msgspec's "... - at `$.a.b`" into a ConfigError naming the field, its value and the
    valid choices."""
    message = str(e)
    match = re.search(r" - at `\$(.*)`$", message)
    path = match.group(1).lstrip(".") if match else ""
    message = message[: match.start()] if match else message
    unknown = re.search(r"unknown field `([^`]+)`", message)
    if unknown:
        struct = _struct_at(path)
        valid = ", ".join(f.name for f in msgspec.structs.fields(struct)) if struct else "?"
        field = reprlib.repr(unknown.group(1))[1:-1]
        return ConfigError(f"{path}.{field}" if path else field, f"unknown field {field!r}; valid fields here: {valid}")
    value = _value_at(raw, path)
    return ConfigError(path or "config", message if value is _NOTHING else f"{message}: {reprlib.repr(value)}")


_NOTHING = object()


def _value_at(raw: Any, path: str) -> Any:
    for part in filter(None, re.split(r"\.|\[(\d+)\]", path)):
        try:
            raw = raw[int(part)] if isinstance(raw, list) else raw[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return _NOTHING
    return raw


def _struct_at(path: str) -> type | None:
    struct: Any = PdsdkConfig
    for part in filter(None, re.split(r"\.|\[\d+\]", path)):
        field_type = {f.name: f.type for f in msgspec.structs.fields(struct)}.get(part)
        struct = _struct_in(field_type)
        if struct is None:
            return None
    return struct


def _struct_in(t: Any) -> type | None:
    """The Struct type inside a field type such as `StoreSpec | None` or `list[StoreSpec]`."""
    if isinstance(t, type) and issubclass(t, msgspec.Struct):
        return t
    return next(filter(None, map(_struct_in, typing.get_args(t))), None)


def _check(cfg: PdsdkConfig, check_plugins: bool) -> None:
    if cfg.failure_policy not in FAILURE_POLICIES:
        raise ConfigError("failure_policy",
                          f"unknown policy {reprlib.repr(cfg.failure_policy)}; valid: {', '.join(FAILURE_POLICIES)}")
    _check_store_shape(cfg.store, "store")
    if check_plugins:
        from pdsdk.plugins import registry

        reg = registry()
        plugins = [("transport", "transport", cfg.transport)] if cfg.transport is not None else []
        plugins += [("store", field, spec) for field, spec in _walk_stores(cfg.store, "store")]
        for kind, field, spec in plugins:
            plugin = reg.get(kind, spec.name, field)
            if plugin.why_not is None:
                try:
                    factory = plugin.load()
                except Exception:  # noqa: BLE001 - the plugin's own error comes when it is built
                    continue
                check_options(factory, spec.options, field)


def _check_store_shape(spec: StoreSpec | None, field: str) -> None:
    if spec is None:
        return
    if (spec.name == "tiered") != bool(spec.tiers):
        raise ConfigError(field, 'a tiered store is written {"tiered": [store, ...]}; '
                                 "other stores take no tiers")
    for i, tier in enumerate(spec.tiers):
        _check_store_shape(tier, f"{field}.tiered[{i}]")


def _walk_stores(spec: StoreSpec | None, field: str):
    if spec is None:
        return
    if spec.tiers:
        for i, tier in enumerate(spec.tiers):
            yield from _walk_stores(tier, f"{field}.tiered[{i}]")
    else:
        yield field, spec
