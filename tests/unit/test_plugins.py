import sys

import pytest

import pdsdk
from pdsdk import MissingDependency
from pdsdk.plugins import PluginSpec, Registrar, Registry, registry


def test_builtins_register_through_the_hooks():
    reg = registry()
    for spec in reg:
        assert spec.source == "pdsdk" or spec.name == "example_dict"
        assert ":" in spec.target


def test_duplicate_names_are_refused_with_both_sources():
    reg = Registry()
    Registrar(reg, "store", "pkg-a").add("same", "a.mod:A")
    with pytest.raises(ValueError, match="registered twice: by pkg-a .* and by pkg-b"):
        Registrar(reg, "store", "pkg-b").add("same", "b.mod:B")


def test_unknown_kind_and_bad_target():
    reg = Registry()
    with pytest.raises(ValueError, match="module:attribute"):
        Registrar(reg, "store", "x").add("s", "no_colon")
    with pytest.raises(ValueError, match="not one of transport, store, policy"):
        reg.add(PluginSpec("router", "r", "a:b", "x"))


def test_missing_library_is_reported_without_import_and_load_names_the_extra():
    spec = PluginSpec("transport", "ghost", "pdsdk_ghost_module:Ghost", "pdsdk", extra="ghost",
                      requires=("pdsdk_ghost_module",))
    assert spec.why_not == 'missing pdsdk_ghost_module: pip install "pdsdk[ghost]"'
    assert "pdsdk_ghost_module" not in sys.modules
    with pytest.raises(MissingDependency, match=r'transport \'ghost\'.*pip install "pdsdk\[ghost\]"'):
        spec.load()


def test_load_of_wrong_attribute_names_the_target():
    spec = PluginSpec("store", "wrong", "pdsdk.kv:NoSuchClass", "somepkg")
    with pytest.raises(ImportError, match="points at pdsdk.kv:NoSuchClass"):
        spec.load()


def test_observers_never_raise_into_the_caller(caplog):
    from pdsdk.plugins import notify, plugin_manager

    class Broken:
        @pdsdk.hookimpl
        def pdsdk_store_miss(self, store, pages):
            raise RuntimeError("observer bug")

    plugin = Broken()
    plugin_manager().register(plugin)
    try:
        notify("pdsdk_store_miss", store="s", pages=1)  # must not raise
    finally:
        plugin_manager().unregister(plugin)
    assert "observer bug" in caplog.text


def test_builtin_metrics_observe_the_hooks():
    from prometheus_client import REGISTRY

    from pdsdk.plugins import notify

    before = REGISTRY.get_sample_value("pdsdk_transfer_bytes_total", {"transport": "t", "path": "shm"}) or 0
    notify("pdsdk_transfer_finished", transport="t", transfer_id="1", peer="p", nbytes=100, seconds=0.01, path="shm")
    assert REGISTRY.get_sample_value("pdsdk_transfer_bytes_total", {"transport": "t", "path": "shm"}) == before + 100
