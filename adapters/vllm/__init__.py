"""vLLM mount: `--kv-transfer-config '{"kv_connector": "PdsdkConnector",
"kv_connector_module_path": "pdsdk.adapters.vllm", "kv_role": ..., "kv_connector_extra_config": {...}}'`.

Imports vLLM: loaded by vLLM's connector factory, never by `import pdsdk`."""

from pdsdk.adapters.vllm.connector import PdsdkConnector

__all__ = ["PdsdkConnector"]
