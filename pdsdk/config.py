"""The connector config shared by vLLM's `kv_connector_extra_config`, SGLang (`PDSDK_CONFIG`)
and the CLI.

Accepted forms: a dict, a JSON string, or `@path` to a JSON, YAML or TOML file. Shorthands:
``"transport": "nixl"`` or ``{"name": "nixl", "options": {...}}``; ``"store": "memory"``,
``{"name": "redis", "options": {...}}``, ``{"tiered": ["memory", "disk"]}`` or ``null``.
Errors name the field, the bad value and the valid choices.
"""

from __future__ import annotations

import hashlib
import json
import re
import typing
from pathlib import Path
from typing import Any

import msgspec
import yaml

from pdsdk.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

FAILURE_POLICIES = ("recompute", "fail")
_NONE = (None, "none", "")


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
    connect_s: float = 10.0  # handshake with a new peer
    transfer_s: float = 30.0  # one transfer, post to completion; past it the transfer fails
    lease_s: float = 120.0  # how long prefill keeps pages for a decode that has not read them


class Retention(_Strict):
    """Default L6 hints for pages this worker stores; requests may override them."""

    priority: int = 0  # higher survives longer under pressure
    ttl_s: float | None = None  # None: until evicted
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
        raw = _read_file(source[1:]) if source.startswith("@") else _parse_json(source, "config")
    else:
        raise ConfigError("config", f"expected a dict, a JSON string or @path, got {type(source).__name__}")
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
        raise _translate(e) from None
    _check(cfg, check_plugins)
    return cfg


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(what, f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def _read_file(path_text: str) -> Any:
    path = Path(path_text).expanduser()
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError("config", f"cannot read config file {str(path)!r}: {e.strerror}") from None
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        try:
            return yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
            raise ConfigError(str(path), f"malformed YAML{where}: {getattr(e, 'problem', e)}") from None
    if suffix == ".toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(str(path), f"malformed TOML: {e}") from None
    if suffix in (".json", ""):
        return _parse_json(text, str(path))
    raise ConfigError(str(path), f"unknown config file type {suffix!r}; use .json, .yaml, .yml or .toml")


def _expand_plugin(value: Any, field: str) -> Any:
    if value in _NONE:
        return None
    return {"name": value} if isinstance(value, str) else value


def _expand_store(value: Any, field: str) -> Any:
    value = _expand_plugin(value, field)
    if isinstance(value, dict) and "tiered" in value:
        tiers = value["tiered"]
        if not isinstance(tiers, list) or not tiers:
            raise ConfigError(f"{field}.tiered", f"must be a non-empty list of stores, got {tiers!r}")
        rest = {k: v for k, v in value.items() if k != "tiered"}
        if set(rest) - {"options"}:
            raise ConfigError(field, f"a tiered store takes only 'tiered' and 'options', got {sorted(rest)}")
        return {"name": "tiered", "options": rest.get("options", {}),
                "tiers": [_expand_store(t, f"{field}.tiered[{i}]") for i, t in enumerate(tiers)]}
    return value


def _translate(e: msgspec.ValidationError) -> ConfigError:
    """Turn msgspec's "... - at `$.a.b`" into a ConfigError naming the field and valid choices."""
    message = str(e)
    match = re.search(r" - at `\$(.*)`$", message)
    path = match.group(1).lstrip(".") if match else ""
    message = message[: match.start()] if match else message
    unknown = re.search(r"unknown field `([^`]+)`", message)
    if unknown:
        struct = _struct_at(path)
        valid = ", ".join(f.name for f in msgspec.structs.fields(struct)) if struct else "?"
        name = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return ConfigError(name, f"unknown field {unknown.group(1)!r}; valid fields here: {valid}")
    return ConfigError(path or "config", message)


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
                          f"unknown policy {cfg.failure_policy!r}; valid: {', '.join(FAILURE_POLICIES)}")
    for name in ("connect_s", "transfer_s", "lease_s"):
        if getattr(cfg.timeouts, name) <= 0:
            raise ConfigError(f"timeouts.{name}", f"must be > 0 seconds, got {getattr(cfg.timeouts, name)!r}")
    if cfg.retention.ttl_s is not None and cfg.retention.ttl_s <= 0:
        raise ConfigError("retention.ttl_s", f"must be > 0 seconds or null, got {cfg.retention.ttl_s!r}")
    _check_store_shape(cfg.store, "store")
    if check_plugins:
        from pdsdk.plugins import registry

        reg = registry()
        if cfg.transport is not None:
            reg.get("transport", cfg.transport.name, "transport")
        for field, spec in _walk_stores(cfg.store, "store"):
            reg.get("store", spec.name, field)


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
