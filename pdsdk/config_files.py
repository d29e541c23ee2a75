"""Reading config text: JSON, and `@path` files in JSON, YAML or TOML, as hostile input.

Files are read up to MAX_BYTES (so `@/dev/zero` ends at once) and must be UTF-8. YAML aliases are
refused (no "billion laughs"), duplicate keys are refused in every format, and documents nested
deeper than MAX_DEPTH are refused. Every problem is a ConfigError naming the file or field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from pdsdk.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

MAX_BYTES = 1 << 20  # a config is a few KB
MAX_DEPTH = 32  # the schema needs about 6 levels; tiers and plugin options a few more
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def parse_json(text: str, what: str) -> Any:
    if len(text) > MAX_BYTES:
        raise ConfigError(what, f"{len(text)} characters of JSON; at most {MAX_BYTES} are read")
    try:
        return _bounded(json.loads(text, object_pairs_hook=lambda pairs: _unique(pairs, what)), what)
    except json.JSONDecodeError as e:
        raise ConfigError(what, f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise _too_deep(what) from None


def read_file(path_text: str) -> Any:
    path = Path(path_text).expanduser()
    where = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError("config", f"cannot read config file {where!r}: {e.strerror}") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(where, f"larger than {MAX_BYTES} bytes; a config file is a few KB")
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        hint = " (it starts with a UTF-16 byte order mark: save it as UTF-8)" if data[:2] in UTF16_BOMS else ""
        raise ConfigError(where, f"not UTF-8 text: byte {data[e.start]:#04x} at byte offset {e.start}{hint}") from None
    suffix = path.suffix.lower()
    if suffix in (".json", ""):
        return parse_json(text, where)
    try:
        if suffix in (".yaml", ".yml"):
            return _bounded(yaml.load(text, Loader=_Loader), where) or {}  # _Loader is a SafeLoader
        if suffix == ".toml":
            return _bounded(tomllib.loads(text), where)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise ConfigError(where, f"malformed YAML{at}: {getattr(e, 'problem', None) or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(where, f"malformed TOML: {e}") from None
    except RecursionError:
        raise _too_deep(where) from None
    raise ConfigError(where, f"unknown config file type {suffix!r}; use .json, .yaml, .yml or .toml")


def check_depth(value: Any, what: str) -> None:
    """Refuse containers nested deeper than MAX_DEPTH (iteratively: no recursion to exhaust)."""
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else ()
        for child in children:
            if isinstance(child, (dict, list, tuple)):
                if depth >= MAX_DEPTH:
                    raise _too_deep(what)
                todo.append((child, depth + 1))


def _bounded(value: Any, what: str) -> Any:
    check_depth(value, what)
    return value


def _too_deep(what: str) -> ConfigError:
    return ConfigError(what, f"nested more than {MAX_DEPTH} levels deep")


def _unique(pairs: list[tuple[str, Any]], what: str) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(what, f"duplicate key {key[:80]!r}")
        out[key] = value
    return out


class _Loader(yaml.SafeLoader):
    """SafeLoader without aliases (their expansion is unbounded) and without duplicate keys."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a pdsdk config",
                                              event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if (key_node.tag, key_node.value) in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key_node.value[:80]!r}",
                                                            key_node.start_mark)
                seen.add((key_node.tag, key_node.value))
        return super().construct_mapping(node, deep)
