"""Third-party plugins found through their entry points, listed, and run through conformance: the
example package (a store and a transport), and a copy of the shipped `fake` transport."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, run_cli

from pdsdk.testing.plugins import plugin_env

EXAMPLE = REPO / "tests" / "plugin_example" / "pdsdk_example_plugin"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(REPO / "tests" / "plugin_example")], check=True,
                   capture_output=True)
    return {"PYTHONPATH": str(site)}


def conformance(kind: str, name: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """The conformance suite of `kind` ("stores", "transports") for plugin `name`, in a fresh pytest."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-c", str(REPO / "pyproject.toml"),
         "--rootdir", str(REPO), str(REPO / "tests" / "conformance" / f"test_{kind}.py"), "-k", name],
        capture_output=True, text=True, cwd=cwd, env={**os.environ, **env}, timeout=300)


def assert_passed(out: subprocess.CompletedProcess, name: str) -> None:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert f"[{name}]" in out.stdout and " passed" in out.stdout and "failed" not in out.stdout


def test_listed_with_its_source_package(plugin_site):
    rows = {r["name"]: r for r in json.loads(run_cli("plugins", "--json", env=plugin_site).stdout)}
    for name, kind in (("example_dict", "store"), ("example_procmem", "transport")):
        assert rows[name]["kind"] == kind and rows[name]["source"] == "pdsdk-example-plugin", rows[name]
        assert rows[name]["loadable"]
    assert "example_dict" not in run_cli("plugins").stdout  # not installed in the suite's own env


def test_usable_in_config(plugin_site):
    assert run_cli("config", "check", '{"store":"example_dict","transport":"example_procmem"}',
                   env=plugin_site).returncode == 0


def test_plugins_import_only_the_public_api():
    fake = Path(importlib.util.find_spec("pdsdk.connectors.transports.fake").origin)
    for path in [fake, *EXAMPLE.glob("*.py")]:
        imports = re.findall(r"^\s*(?:from|import) (pdsdk\S*)", path.read_text(), re.M)
        assert set(imports) <= {"pdsdk"}, f"{path.name} imports {imports}: plugins use `from pdsdk import ...`"


def test_the_example_store_passes_the_store_conformance_suite(plugin_site, tmp_path):
    assert_passed(conformance("stores", "example_dict", plugin_site, tmp_path), "example_dict")


@pytest.mark.slow  # a few seconds of subprocesses: the full suite
def test_the_example_transport_passes_the_transport_conformance_suite(plugin_site, tmp_path):
    assert_passed(conformance("transports", "example_procmem", plugin_site, tmp_path), "example_procmem")


@pytest.mark.slow  # a few seconds of subprocesses: the full suite
def test_a_copy_of_the_fake_transport_is_a_plugin_that_passes_conformance(tmp_path):
    """How a newcomer starts a transport: copy fake.py, rename it, register it from a plugin module."""
    site = tmp_path / "site"
    site.mkdir()
    fake = Path(importlib.util.find_spec("pdsdk.connectors.transports.fake").origin).read_text()
    (site / "my_transport.py").write_text(fake.replace("FakeTransport", "MyTransport"))
    (site / "my_plugin.py").write_text(
        "import pdsdk\n\n\n@pdsdk.hookimpl\ndef pdsdk_add_transports(registrar):\n"
        "    registrar.add('my_copy', 'my_transport:MyTransport', summary='a copy of fake')\n")
    env = plugin_env(site, "my_plugin", name="my-first-transport")
    rows = {r["name"]: r for r in json.loads(run_cli("plugins", "--json", env=env).stdout)}
    assert rows["my_copy"]["source"] == "my-first-transport" and rows["my_copy"]["loadable"]
    assert_passed(conformance("transports", "my_copy", env, tmp_path), "my_copy")
