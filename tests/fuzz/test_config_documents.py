"""Fuzz: config documents, as JSON, YAML and TOML text and as raw file bytes. Each one either loads
or is refused with a ConfigError (what `pdsdk config check` prints as one line): nothing else."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdsdk import ConfigError
from pdsdk.config import PdsdkConfig, load_config

FIELDS = ["transport", "store", "timeouts", "connect_s", "transfer_s", "lease_s", "failure_policy", "retention",
          "priority", "ttl_s", "pin", "name", "options", "tiered", "tiers", "capacity_bytes", "segment_bytes",
          "path", "io_threads", "fsync", "threads", "memory", "disk", "local", "nixl", "recompute"]
NUMBERS = st.one_of(st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, -1, 1, 1e999, -0.0, 1 << 63]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.sampled_from(FIELDS), st.text(max_size=20))
DOCS = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)), inner,
                                                 max_size=5)), max_leaves=30)
# Documents shaped like a config, with hostile values where the schema has numbers and names.
CONFIGS = st.fixed_dictionaries({}, optional={
    "transport": st.one_of(st.sampled_from(["local", None, "nope"]), st.fixed_dictionaries(
        {"name": st.just("local")}, optional={"options": st.dictionaries(st.sampled_from(["threads", "x"]), SCALARS)})),
    "store": st.one_of(st.sampled_from(["memory", "disk", None]), DOCS, st.fixed_dictionaries(
        {"name": st.sampled_from(["memory", "disk"])},
        optional={"options": st.dictionaries(st.sampled_from(["capacity_bytes", "segment_bytes", "io_threads", "fsync",
                                                              "path", "bogus"]), SCALARS)})),
    "timeouts": st.dictionaries(st.sampled_from(["connect_s", "transfer_s", "lease_s"]), SCALARS),
    "retention": st.dictionaries(st.sampled_from(["priority", "ttl_s", "pin"]), SCALARS),
    "failure_policy": SCALARS,
})
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _loads_or_refuses(source) -> None:
    try:
        cfg = load_config(source)
    except ConfigError as e:
        assert str(e) and len(str(e)) < 2000  # one readable line, whatever the input
        return
    assert isinstance(cfg, PdsdkConfig)
    for name in ("connect_s", "transfer_s", "lease_s"):
        value = getattr(cfg.timeouts, name)
        assert math.isfinite(value) and value > 0
    cfg.fingerprint()


@FUZZ
@given(doc=st.one_of(CONFIGS, DOCS))
def test_json_text(doc):
    _loads_or_refuses(json.dumps(doc))


@FUZZ
@given(doc=st.one_of(CONFIGS, DOCS), suffix=st.sampled_from([".json", ".yaml", ".toml"]))
def test_files(doc, suffix):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"c{suffix}"
        if suffix == ".yaml":
            path.write_text(yaml.safe_dump(doc))
        elif suffix == ".json":
            path.write_text(json.dumps(doc))
        else:
            path.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in (doc.items() if isinstance(doc, dict) else [])))
        _loads_or_refuses(f"@{path}")


@FUZZ
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".json", ".yaml", ".toml", ""]))
def test_raw_bytes(data, suffix):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"c{suffix}"
        path.write_bytes(data)
        _loads_or_refuses(f"@{path}")


@FUZZ
@given(text=st.text(alphabet=st.sampled_from(list("{}[]:,&*-!|>'\"\n #<=a1.")), max_size=200))
def test_yaml_syntax_soup(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        path.write_text(text)
        _loads_or_refuses(f"@{path}")


@pytest.mark.slow
@settings(max_examples=3000, deadline=None)
@given(doc=st.one_of(CONFIGS, DOCS))
def test_json_text_long(doc):
    _loads_or_refuses(json.dumps(doc))
