"""The plugin manager and the registry of transports, stores and policies.

Built-in parts register through the hooks in `pdsdk.hookspecs`, exactly like third-party
plugins found under the entry-point group "pdsdk". The registry keeps, per plugin, a lazy
"module:attribute" target: nothing optional is imported until a plugin is used.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import threading
from dataclasses import dataclass, field

import pluggy

from pdsdk import hookspecs
from pdsdk.errors import ConfigError, MissingDependency

log = logging.getLogger(__name__)

KINDS = ("transport", "store", "policy")
_ADD_HOOK = {"transport": "pdsdk_add_transports", "store": "pdsdk_add_stores", "policy": "pdsdk_add_policies"}
# Modules whose hookimpls register the built-in parts. Importing them imports no optional library.
BUILTIN_PLUGINS = (
    "pdsdk.connectors.transports",
    "pdsdk.connectors.stores",
    "pdsdk.router",
    "pdsdk.metrics",
)
ENTRY_POINT_GROUP = hookspecs.PROJECT


@dataclass(frozen=True)
class PluginSpec:
    """One registered plugin: what it is, where it came from, and what it needs."""

    kind: str
    name: str
    target: str  # "module:attribute"
    source: str  # distribution that registered it ("pdsdk" for built-ins)
    extra: str | None = None  # pdsdk extra that installs its dependencies
    requires: tuple[str, ...] = ()  # top-level modules it imports
    summary: str = ""

    def missing(self) -> list[str]:
        """Required modules not installed here. Uses find_spec: nothing is imported."""
        return [m for m in self.requires if not _importable(m.split(".")[0])]

    @property
    def install_hint(self) -> str:
        return f'pip install "pdsdk[{self.extra}]"' if self.extra else f"pip install {' '.join(self.requires)}"

    @property
    def why_not(self) -> str | None:
        """None when loadable; otherwise what is missing and the command that fixes it."""
        missing = self.missing()
        return f"missing {', '.join(missing)}: {self.install_hint}" if missing else None

    def load(self):
        """Import and return the factory; a missing library becomes a one-line MissingDependency."""
        module_name, _, attr = self.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise MissingDependency(f"{self.kind} '{self.name}'", self.extra, e) from e
        try:
            return getattr(module, attr)
        except AttributeError:
            raise ImportError(f"{self.kind} '{self.name}' ({self.source}) points at {self.target}, "
                              f"which does not exist") from None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass
class Registry:
    """Every plugin by (kind, name), plus entry points that failed to load."""

    specs: dict[tuple[str, str], PluginSpec] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)  # entry point -> error

    def add(self, spec: PluginSpec) -> None:
        if spec.kind not in KINDS:
            raise ValueError(f"plugin kind {spec.kind!r} is not one of {', '.join(KINDS)}")
        old = self.specs.get((spec.kind, spec.name))
        if old is not None and old != spec:
            raise ValueError(f"{spec.kind} '{spec.name}' is registered twice: by {old.source} ({old.target}) "
                             f"and by {spec.source} ({spec.target}); rename one of them")
        self.specs[(spec.kind, spec.name)] = spec

    def names(self, kind: str) -> list[str]:
        return sorted(name for k, name in self.specs if k == kind)

    def get(self, kind: str, name: str, field: str | None = None) -> PluginSpec:
        """The spec for `name`; an unknown name is a ConfigError listing the registered ones."""
        try:
            return self.specs[(kind, name)]
        except KeyError:
            known = ", ".join(self.names(kind)) or "none"
            raise ConfigError(field or kind, f"unknown {kind} {name!r}; registered {kind}s: {known}") from None

    def load(self, kind: str, name: str):
        return self.get(kind, name).load()

    def __iter__(self):
        return iter(sorted(self.specs.values(), key=lambda s: (KINDS.index(s.kind), s.name)))


class Registrar:
    """What a registration hook receives: adds plugins of one kind from one source."""

    def __init__(self, registry: Registry, kind: str, source: str):
        self._registry, self.kind, self.source = registry, kind, source

    def add(self, name: str, target: str, *, extra: str | None = None,
            requires: tuple[str, ...] | list[str] = (), summary: str = "") -> None:
        if ":" not in target:
            raise ValueError(f"{self.kind} '{name}': target {target!r} must look like 'module:attribute'")
        self._registry.add(PluginSpec(self.kind, name, target, self.source, extra, tuple(requires), summary))


class _State:
    lock = threading.Lock()
    pm: pluggy.PluginManager | None = None
    registry: Registry | None = None
    sources: dict[str, str] = {}
    broken: dict[str, str] = {}


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, built on first use."""
    with _State.lock:
        if _State.pm is None:
            _State.pm, _State.sources, _State.broken = _build_plugin_manager()
        return _State.pm


def _build_plugin_manager():
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    sources: dict[str, str] = {}
    broken: dict[str, str] = {}
    for module_name in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
        sources[module_name] = "pdsdk"
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        plugin_name = f"{ep.name} ({ep.value})"
        if pm.get_plugin(plugin_name) is not None:
            continue
        try:
            pm.register(ep.load(), name=plugin_name)
        except Exception as e:  # a broken third-party plugin must not take pdsdk down
            broken[plugin_name] = f"{type(e).__name__}: {e}"
            log.warning("pdsdk plugin %s failed to load: %s", plugin_name, e)
            continue
        sources[plugin_name] = ep.dist.name if ep.dist else ep.value.split(".")[0]
    return pm, sources, broken


def registry() -> Registry:
    """Every registered transport, store and policy (cached; `reset()` rebuilds it)."""
    pm = plugin_manager()
    with _State.lock:
        if _State.registry is None:
            reg = Registry(broken=dict(_State.broken))
            for kind, hook_name in _ADD_HOOK.items():
                for impl in getattr(pm.hook, hook_name).get_hookimpls():
                    source = _State.sources.get(impl.plugin_name, impl.plugin_name)
                    impl.function(registrar=Registrar(reg, kind, source))
            _State.registry = reg
        return _State.registry


def reset() -> None:
    """Forget the plugin manager and registry (tests; after installing a plugin at run time)."""
    with _State.lock:
        _State.pm = _State.registry = None


def notify(hook: str, **kwargs) -> None:
    """Call an observation hook; a failing observer is logged, never raised into the caller."""
    try:
        getattr(plugin_manager().hook, hook)(**kwargs)
    except Exception:  # noqa: BLE001 - observers must not break the data path
        log.exception("pdsdk observer failed in %s", hook)
