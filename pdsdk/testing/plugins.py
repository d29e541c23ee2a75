"""Register a plugin module for processes a test starts, the way a third-party package does, without installing one."""

from __future__ import annotations

import os
from pathlib import Path


def plugin_env(directory: Path, module: str, name: str = "pdsdk-test-plugin") -> dict[str, str]:
    """Environment for child processes in which `module` (importable there, or a file in `directory`) is a
    pdsdk plugin: `directory` gets a distribution `name` declaring it under the entry-point group "pdsdk",
    and goes first on PYTHONPATH."""
    info = Path(directory) / f"{name.replace('-', '_')}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[pdsdk]\n{module.rpartition('.')[2]} = {module}\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))}
