"""vLLM mount: `--kv-transfer-config '{"kv_connector": "PdsdkConnector",
"kv_connector_module_path": "pdsdk.adapters.vllm", "kv_role": ..., "kv_connector_extra_config": {...}}'`.

`PdsdkConnector` is imported on first access (vLLM's factory does `getattr(module, name)`), so the
launcher can use `pdsdk.adapters.vllm.command` without importing vLLM.
"""

__all__ = ["PdsdkConnector"]


def __getattr__(name: str):
    if name == "PdsdkConnector":
        from pdsdk.adapters.vllm.connector import PdsdkConnector

        return PdsdkConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
