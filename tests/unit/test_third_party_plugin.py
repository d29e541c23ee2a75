"""A third-party package found through its entry point, listed, and run through conformance."""

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, run_cli


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(REPO / "tests" / "plugin_example")], check=True,
                   capture_output=True)
    return {"PYTHONPATH": str(site)}


def test_listed_with_its_source_package(plugin_site):
    rows = json.loads(run_cli("plugins", "--json", env=plugin_site).stdout)
    row = next(r for r in rows if r["name"] == "example_dict")
    assert row["kind"] == "store" and row["source"] == "pdsdk-example-plugin" and row["loadable"]
    assert "example_dict" not in run_cli("plugins").stdout  # not installed in the suite's own env


def test_usable_in_config(plugin_site):
    assert run_cli("config", "check", '{"store":"example_dict"}', env=plugin_site).returncode == 0


def test_runs_through_the_store_conformance_suite(plugin_site, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-c", str(REPO / "pyproject.toml"),
         "--rootdir", str(REPO), str(REPO / "tests" / "conformance" / "test_stores.py"), "-k", "example_dict"],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, **plugin_site}, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "[example_dict]" in out.stdout and " passed" in out.stdout and "failed" not in out.stdout
