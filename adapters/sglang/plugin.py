"""The `sglang.srt.plugins` entry point: makes `--disaggregation-transfer-backend pdsdk` work.

SGLang has no transfer-backend registry (a closed Enum and a closed `get_kv_class`), but from
0.5.15 on it runs every `sglang.srt.plugins` entry point early in each process (launcher,
scheduler, detokenizer) and then applies HookRegistry hooks. `register()`:
1. adds "pdsdk" to the CLI choices (`add_disagg_transfer_backend_choices`);
2. adds a `TransferBackend.PDSDK` member, so `TransferBackend("pdsdk")` resolves;
3. wraps `disaggregation.utils.get_kv_class` (AROUND hook) to return pdsdk's classes for it;
   HookRegistry also rebinds the copies prefill.py, decode.py and disagg_service.py imported.
Idempotent; the backend classes are imported only when SGLang asks for them.
"""

from __future__ import annotations

import logging
from typing import Any

from pdsdk.compat.sglang import BACKEND

log = logging.getLogger(__name__)
TARGET = "sglang.srt.disaggregation.utils.get_kv_class"
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    _add_enum_member()
    HookRegistry.register(TARGET, _get_kv_class, HookType.AROUND)
    _registered = True


def _add_enum_member() -> None:
    """`TransferBackend` is a plain Enum: add a member the way Enum itself builds them."""
    from sglang.srt.disaggregation.utils import TransferBackend

    if BACKEND in TransferBackend._value2member_map_:
        return
    member = object.__new__(TransferBackend)
    member._name_, member._value_ = BACKEND.upper(), BACKEND
    TransferBackend._value2member_map_[BACKEND] = member
    TransferBackend._member_map_[BACKEND.upper()] = member
    TransferBackend._member_names_.append(BACKEND.upper())
    type.__setattr__(TransferBackend, BACKEND.upper(), member)


def kv_classes() -> dict[str, type]:
    """KVClassType value -> pdsdk class (KVARGS is SGLang's shared KVArgs)."""
    from pdsdk.adapters.sglang.conn import PdsdkKVBootstrapServer, PdsdkKVReceiver, PdsdkKVSender
    from pdsdk.adapters.sglang.manager import PdsdkKVManager

    return {"manager": PdsdkKVManager, "sender": PdsdkKVSender, "receiver": PdsdkKVReceiver,
            "bootstrap_server": PdsdkKVBootstrapServer}


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any, *args: Any, **kwargs: Any) -> Any:
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(transfer_backend, class_type, *args, **kwargs)
    if class_type.value == "kvargs":  # 0.5.15 maps KVARGS per backend, so it would not know ours
        from sglang.srt.disaggregation.base.conn import KVArgs

        return KVArgs
    return kv_classes()[class_type.value]
