"""Hostile config documents: each is refused quickly, with a ConfigError naming the file or field
(and `pdsdk config check` exits 2 with one line, no traceback)."""

from __future__ import annotations

import json
import time

import pytest
from helpers import run_cli

from pdsdk import ConfigError
from pdsdk.config import load_config
from pdsdk.connectors.stores.factory import open_store

# 9 levels of 9 aliases: 9**9 strings once expanded, in 300 bytes.
LAUGHS = "store:\n  name: memory\n  options:\n    l0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"    l{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9))
DEEP = "[" * 100_000 + "]" * 100_000


def _refused(source, *words, field=None):
    t = time.monotonic()
    with pytest.raises(ConfigError) as e:
        load_config(source)
    assert time.monotonic() - t < 2
    for word in words:
        assert word in str(e.value)
    if field is not None:
        assert e.value.field == field
    return e.value


def test_yaml_aliases_are_refused_before_any_expansion(tmp_path):
    (tmp_path / "laughs.yaml").write_text(LAUGHS)
    (tmp_path / "self.yaml").write_text("transport: &t [*t]\n")
    (tmp_path / "merge.yaml").write_text("base: &b {transport: nixl}\n<<: *b\n")
    for name in ("laughs.yaml", "self.yaml", "merge.yaml"):
        _refused(f"@{tmp_path / name}", "aliases", name, field=str(tmp_path / name))


@pytest.mark.parametrize("name, text", [
    ("deep.json", DEEP), ("deep.yaml", DEEP), ("deep.toml", "a = " + DEEP), ("deep", DEEP),
    ("nested.json", json.dumps({"store": {"name": "memory", "options": {"x": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}})),
])
def test_deep_documents_are_refused(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    _refused(f"@{tmp_path / name}", "nested more than 32 levels deep")


def test_deep_json_text_and_dicts_are_refused():
    _refused(DEEP, "nested more than")
    deep: dict = {}
    for _ in range(10_000):
        deep = {"x": deep}
    _refused({"store": {"name": "memory", "options": deep}}, "nested more than")


@pytest.mark.parametrize("data, offset, words", [
    ('{"transport": null}'.encode("utf-16"), 0, ["UTF-16 byte order mark"]),
    ('{"transport": "nixl\xe9"}'.encode("latin-1"), 19, ["byte 0xe9"]),
    (b"transport: nixl\nstore: \xff\xfe\n", 23, ["byte 0xff"]),
])
def test_non_utf8_files_name_the_file_and_byte_offset(tmp_path, data, offset, words):
    path = tmp_path / "c.yaml"
    path.write_bytes(data)
    _refused(f"@{path}", "not UTF-8", f"byte offset {offset}", *words, field=str(path))


def test_endless_and_huge_files_are_refused_by_size(tmp_path):
    _refused("@/dev/zero", "larger than 1048576 bytes", field="/dev/zero")
    (tmp_path / "big.json").write_text('{"transport": null, "pad": "' + "x" * (2 << 20) + '"}')
    _refused(f"@{tmp_path / 'big.json'}", "larger than")


@pytest.mark.parametrize("name, text", [
    ("dup.json", '{"transport": "nixl", "transport": null}'),
    ("dup.yaml", "transport: nixl\nstore: memory\ntransport: null\n"),
    ("nested.yaml", "store:\n  name: memory\n  options: {capacity_bytes: 1, capacity_bytes: 2}\n"),
    ("dup.toml", 'transport = "nixl"\ntransport = "local"\n'),
])
def test_duplicate_keys_are_refused(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    error = _refused(f"@{tmp_path / name}")
    assert "duplicate key" in str(error) or "Cannot overwrite" in str(error)


@pytest.mark.parametrize("raw, field", [
    ('{"timeouts": {"connect_s": NaN}}', "timeouts.connect_s"),
    ('{"timeouts": {"connect_s": Infinity}}', "timeouts.connect_s"),
    ('{"timeouts": {"connect_s": 1e999}}', "timeouts.connect_s"),
    ('{"timeouts": {"lease_s": 0}}', "timeouts.lease_s"),
    ('{"timeouts": {"transfer_s": -Infinity}}', "timeouts.transfer_s"),
    ('{"retention": {"ttl_s": NaN}}', "retention.ttl_s"),
    ('{"retention": {"priority": 1e400}}', "retention.priority"),
    ('{"store": {"name": "memory", "options": {"capacity_bytes": -1}}}', "store.options.capacity_bytes"),
    ('{"store": {"name": "memory", "options": {"capacity_bytes": "lots"}}}', "store.options.capacity_bytes"),
    ('{"store": {"name": "memory", "options": {"capacity_bytes": 0}}}', "store.options.capacity_bytes"),
    ('{"store": {"name": "memory", "options": {"capacity_bytes": true}}}', "store.options.capacity_bytes"),
    ('{"store": {"name": "disk", "options": {"segment_bytes": 0}}}', "store.options.segment_bytes"),
    ('{"store": {"name": "disk", "options": {"io_threads": -2}}}', "store.options.io_threads"),
    ('{"store": {"name": "disk", "options": {"fsync": "yes"}}}', "store.options.fsync"),
    ('{"store": {"name": "disk", "options": {"capacty_bytes": 5}}}', "store.options.capacty_bytes"),
    ('{"store": {"tiered": ["memory", {"name": "disk", "options": {"capacity_bytes": NaN}}]}}',
     "store.tiered[1].options.capacity_bytes"),
    ('{"transport": {"name": "local", "options": {"threads": 0}}}', "transport.options.threads"),
    ('{"transport": {"name": "local", "options": {"thread": 2}}}', "transport.options.thread"),
])
def test_meaningless_numbers_and_options_are_refused_naming_the_field(raw, field):
    raw = raw if '"transport"' in raw else raw[:-1] + ', "transport": null}'
    _refused(raw, field=field)


def test_sane_options_pass():
    cfg = load_config({"transport": {"name": "local", "options": {"threads": 4}},
                       "store": {"tiered": [{"name": "memory", "options": {"capacity_bytes": 1 << 20}},
                                            {"name": "disk", "options": {"path": "/tmp/x", "segment_bytes": 4096,
                                                                         "io_threads": 1}}]},
                       "timeouts": {"connect_s": 0.5}, "retention": {"ttl_s": 60, "priority": -3}})
    assert cfg.store.tiers[1].options["segment_bytes"] == 4096


def test_open_store_refuses_bad_options_naming_them():
    with pytest.raises(ConfigError, match="store.options.capacity_bytes"):
        open_store({"name": "memory", "options": {"capacity_bytes": "lots"}})


@pytest.mark.parametrize("doc", ["@/dev/zero", DEEP[:20_000] + DEEP[-20_000:], '{"timeouts": {"connect_s": NaN}}'])
def test_config_check_exits_2_with_one_line(tmp_path, doc):
    out = run_cli("config", "check", doc)
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr
    assert len(out.stderr) < 500


def test_config_check_billion_laughs_fails_fast(tmp_path):
    (tmp_path / "laughs.yaml").write_text(LAUGHS)
    t = time.monotonic()
    out = run_cli("config", "check", f"@{tmp_path / 'laughs.yaml'}", timeout=30)
    assert out.returncode == 2 and "aliases" in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - t < 15  # the CLI's start-up; the refusal itself is instant
