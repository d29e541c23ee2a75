"""Command lines and environment for SGLang workers with the pdsdk backend (the launcher calls
`server_command`). Needs no SGLang: tests/sglang checks SGLang's own parser accepts the result."""

from __future__ import annotations

import json
import sys
from typing import Any

from pdsdk.adapters.sglang.settings import ENV
from pdsdk.compat.sglang import BACKEND
from pdsdk.ports import free_port

ROLES = ("prefill", "decode", "worker")
BOOTSTRAP_PORT_ENV = "PDSDK_BOOTSTRAP_PORT"  # the launcher hands it to the router: "--prefill URL PORT"


def hicache_args(store: Any, *, model: str | None = None, ratio: float | None = None,
                 zero_copy: bool = True) -> list[str]:
    """`--enable-hierarchical-cache ... --hicache-storage-backend dynamic` with pdsdk's storage class
    over `store` (any pdsdk store spec: "memory", {"name": "redis", ...}, {"tiered": [...]})."""
    extra = {"backend_name": "pdsdk", "module_path": "pdsdk.adapters.sglang.hicache",
             "class_name": "PdsdkHiCacheStorage", "store": store, "interface_v1": 1 if zero_copy else 0}
    if model:
        extra["model"] = model
    args = ["--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(extra)]
    if zero_copy:
        args += ["--hicache-mem-layout", "page_first"]  # v1 needs a page-first host pool
    if ratio:
        args += ["--hicache-ratio", str(ratio)]
    return args


def server_command(model: str, port: int, *, host: str = "127.0.0.1", role: str = "worker",
                   pdsdk_config: dict[str, Any] | None = None, served_name: str | None = None, tp: int = 1,
                   bootstrap_port: int | None = None, page_size: int | None = None,
                   python: str = sys.executable, extra_args: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:
    """(`python -m sglang.launch_server ...`, environment) for a worker of `role`.

    prefill/decode: PD mode with transfer backend pdsdk; the pdsdk config travels in PDSDK_CONFIG.
    A prefill serves its bootstrap server on `bootstrap_port` (a free one when not given), returned
    in the environment as PDSDK_BOOTSTRAP_PORT for the router. "worker": a plain server."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}; valid: {', '.join(ROLES)}")
    # -P: keep the working directory off sys.path (a pdsdk checkout there would shadow the install).
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    cmd = [python, *safe_path, "-m", "sglang.launch_server", "--model-path", model, "--host", host,
           "--port", str(port)]
    if served_name:
        cmd += ["--served-model-name", served_name]
    if tp > 1:
        cmd += ["--tp-size", str(tp)]
    if page_size:
        cmd += ["--page-size", str(page_size)]
    env: dict[str, str] = {}
    if role != "worker":
        cmd += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", BACKEND]
        if role == "prefill":
            bootstrap_port = bootstrap_port or free_port(host if host not in ("0.0.0.0", "::") else "127.0.0.1")
            cmd += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
            env[BOOTSTRAP_PORT_ENV] = str(bootstrap_port)
        env[ENV] = json.dumps(pdsdk_config if pdsdk_config is not None else {"transport": "nixl"})
        plugins = _plugins_whitelist()
        if plugins:
            env["SGLANG_PLUGINS"] = plugins
    return cmd + list(extra_args), env


def _plugins_whitelist() -> str:
    """Keep the pdsdk plugin on when a user whitelists plugins (SGLANG_PLUGINS is a whitelist)."""
    import os

    current = [p for p in os.environ.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    return ",".join(current + ["pdsdk"]) if current and "pdsdk" not in current else ",".join(current)
