import json

import pytest

from pdsdk import ConfigError
from pdsdk.config import PdsdkConfig, load_config
from pdsdk.plugins import registry


def test_defaults_and_shorthands():
    cfg = load_config({"transport": "nixl"})
    assert cfg.transport.name == "nixl" and cfg.store is None and cfg.failure_policy == "recompute"
    assert load_config(None).transport.name == "nixl"
    assert load_config({"transport": None}).transport is None


def test_json_string_and_files_give_the_same_config(tmp_path):
    data = {"transport": {"name": "nixl", "options": {"backends": ["UCX"]}}, "timeouts": {"transfer_s": 5}}
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.yaml").write_text("transport:\n  name: nixl\n  options:\n    backends: [UCX]\ntimeouts:\n  transfer_s: 5\n")
    (tmp_path / "c.toml").write_text('[transport]\nname = "nixl"\n[transport.options]\nbackends = ["UCX"]\n'
                                     "[timeouts]\ntransfer_s = 5\n")
    configs = [load_config(json.dumps(data))] + [load_config(f"@{tmp_path / n}") for n in ("c.json", "c.yaml", "c.toml")]
    assert len({c.fingerprint() for c in configs}) == 1
    assert configs[0].timeouts.transfer_s == 5.0


def test_fingerprint_round_trips_and_changes():
    cfg = load_config({"transport": "nixl", "timeouts": {"connect_s": 3}})
    assert load_config(cfg).fingerprint() == cfg.fingerprint()
    assert load_config({"transport": "nixl"}).fingerprint() != cfg.fingerprint()


def test_malformed_json_reports_line_and_column():
    with pytest.raises(ConfigError, match=r"malformed JSON at line 2 column 11: Expecting value"):
        load_config('{"transport": "nixl",\n "store": mem}')


def test_malformed_yaml_reports_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("transport: nixl\nstore: [memory\n")
    with pytest.raises(ConfigError, match=r"malformed YAML at line \d+ column \d+"):
        load_config(f"@{tmp_path / 'bad.yaml'}")


def test_missing_file_is_named():
    with pytest.raises(ConfigError, match="cannot read config file '/nonexistent.json'"):
        load_config("@/nonexistent.json")


@pytest.mark.parametrize("raw, field, words", [
    ({"transprt": "nixl"}, "transprt", ["unknown field", "transport", "store", "timeouts"]),
    ({"timeouts": {"transfer": 1}}, "timeouts.transfer", ["connect_s", "transfer_s", "lease_s"]),
    ({"timeouts": {"transfer_s": "fast"}}, "timeouts.transfer_s", ["Expected `float`, got `str`"]),
    ({"timeouts": {"transfer_s": -1}}, "timeouts.transfer_s", ["> 0", ": -1"]),
    ({"failure_policy": "retry"}, "failure_policy", ["'retry'", "recompute", "fail"]),
    ({"retention": {"pin": "yes"}}, "retention.pin", ["Expected `bool`"]),
    ({"store": {"tiered": []}}, "store.tiered", ["non-empty list"]),
    ({"store": {"name": "memory", "optons": {}}}, "store.optons", ["options", "tiers"]),
    ("[1, 2]", "config", ["must be an object"]),
    (42, "config", ["expected a dict, a JSON string or @path"]),
])
def test_validation_errors_name_field_value_and_choices(raw, field, words):
    with pytest.raises(ConfigError) as e:
        load_config(raw, check_plugins=False)
    assert e.value.field == field
    for word in words:
        assert word in str(e.value)


def test_unknown_plugin_lists_registered_ones():
    with pytest.raises(ConfigError) as e:
        load_config({"transport": "carrier-pigeon"})
    assert e.value.field == "transport"
    assert "carrier-pigeon" in str(e.value)
    for name in registry().names("transport"):
        assert name in str(e.value)


def test_tiered_store_names_the_bad_tier():
    known = registry().names("store")
    if not known:
        pytest.skip("no store registered yet")
    with pytest.raises(ConfigError) as e:
        load_config({"store": {"tiered": [known[0], "nosuch"]}})
    assert e.value.field == "store.tiered[1]"


def test_tiered_store_expands():
    cfg = load_config({"store": {"tiered": ["memory", {"name": "disk", "options": {"path": "/tmp/x"}}]}},
                      check_plugins=False)
    assert cfg.store.name == "tiered"
    assert [t.name for t in cfg.store.tiers] == ["memory", "disk"]
    assert cfg.store.tiers[1].options == {"path": "/tmp/x"}
    assert isinstance(cfg, PdsdkConfig)
