"""The `sglang.srt.plugins` entry point, the command builder against SGLang's own argument parser,
PDSDK_CONFIG validation, and the page geometry (in-process, no servers)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from pdsdk.adapters.sglang.command import BOOTSTRAP_PORT_ENV, hicache_args, server_command
from pdsdk.adapters.sglang.geometry import layout_from_kv_args, transfer_spans
from pdsdk.adapters.sglang.settings import config_from_env
from pdsdk.compat import sglang as compat
from pdsdk.errors import ConfigError


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A local model directory: 0.5.15 reads the model config while building ServerArgs."""
    from pdsdk.tinymodel import make_tiny_model

    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model(path)
    return str(path)


@pytest.fixture(scope="module")
def plugins():
    from sglang.srt.plugins import load_plugins

    load_plugins()  # finds pdsdk's entry point through importlib.metadata, like every SGLang process


def parse(cmd: list[str]):
    """SGLang's own parser, as launch_server builds it. `--device cpu`: 0.5.15 resolves the device
    while building ServerArgs and finds no accelerator on this machine."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = cmd[cmd.index("sglang.launch_server") + 1:]
    return ServerArgs.from_cli_args(parser.parse_args(argv + ["--device", "cpu"]))


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "pdsdk"]
    assert ep.value == "pdsdk.adapters.sglang.plugin:register"


def test_get_kv_class_returns_pdsdk_classes_everywhere(plugins):
    import sglang.srt.disaggregation.decode as decode
    import sglang.srt.disaggregation.prefill as prefill
    import sglang.srt.disaggregation.utils as utils
    import sglang.srt.managers.disagg_service as disagg_service
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.fake.conn import FakeKVSender
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    from pdsdk.adapters.sglang.conn import PdsdkKVBootstrapServer, PdsdkKVReceiver, PdsdkKVSender
    from pdsdk.adapters.sglang.manager import PdsdkKVManager

    backend = TransferBackend("pdsdk")
    assert backend is TransferBackend.PDSDK and backend.value == "pdsdk"
    expected = {KVClassType.MANAGER: PdsdkKVManager, KVClassType.SENDER: PdsdkKVSender,
                KVClassType.RECEIVER: PdsdkKVReceiver, KVClassType.BOOTSTRAP_SERVER: PdsdkKVBootstrapServer,
                KVClassType.KVARGS: KVArgs}
    for module in (utils, prefill, decode, disagg_service):  # the modules that call it
        for class_type, cls in expected.items():
            assert module.get_kv_class(backend, class_type) is cls, (module.__name__, class_type)
        assert module.get_kv_class(TransferBackend.FAKE, KVClassType.SENDER) is FakeKVSender  # others untouched


def test_server_args_accept_the_backend(plugins, model):
    from sglang.srt.server_args import DISAGG_TRANSFER_BACKEND_CHOICES

    assert "pdsdk" in DISAGG_TRANSFER_BACKEND_CHOICES
    args = parse(["-m", "sglang.launch_server", "--model-path", model, "--disaggregation-mode", "decode",
                  "--disaggregation-transfer-backend", "pdsdk"])
    assert args.disaggregation_transfer_backend == "pdsdk"


def test_plugin_is_idempotent(plugins):
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.server_args import DISAGG_TRANSFER_BACKEND_CHOICES

    from pdsdk.adapters.sglang import plugin

    plugin.register()
    plugin.register()
    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("pdsdk") == 1
    assert [m.value for m in TransferBackend].count("pdsdk") == 1


@pytest.mark.parametrize("role", ["prefill", "decode", "worker"])
def test_command_builder_flags_parse(plugins, model, role):
    config = {"transport": "mooncake", "timeouts": {"transfer_s": 5}}
    # HiCache needs the radix cache, which decode workers turn off (SGLang refuses the mix).
    hicache = hicache_args({"tiered": ["memory", "disk"]}) if role != "decode" else []
    cmd, env = server_command(model, 30001, role=role, pdsdk_config=config, served_name="tiny", tp=2,
                              page_size=32, extra_args=tuple(hicache))
    args = parse(cmd)
    assert (args.model_path, args.port, args.tp_size, args.page_size, args.served_model_name) == \
        (model, 30001, 2, 32, "tiny")
    if hicache:
        assert args.hicache_storage_backend == "dynamic"
        extra = json.loads(args.hicache_storage_backend_extra_config)
        assert extra["module_path"] == "pdsdk.adapters.sglang.hicache" and extra["interface_v1"] == 1
    if role == "worker":
        assert args.disaggregation_mode == "null" and not env
        return
    assert (args.disaggregation_mode, args.disaggregation_transfer_backend) == (role, "pdsdk")
    assert config_from_env(env).transport.name == "mooncake"  # what the workers will read back
    if role == "prefill":
        assert args.disaggregation_bootstrap_port == int(env[BOOTSTRAP_PORT_ENV])


def test_config_from_env_names_the_problem(tmp_path):
    assert config_from_env({}).transport.name == "nixl"  # unset: the defaults
    path = tmp_path / "pdsdk.yaml"
    path.write_text("transport: nccl\ntimeouts: {transfer_s: 3}\n")
    assert config_from_env({"PDSDK_CONFIG": f"@{path}"}).timeouts.transfer_s == 3
    with pytest.raises(ConfigError, match=r"PDSDK_CONFIG config: malformed JSON"):
        config_from_env({"PDSDK_CONFIG": "{transport: nixl"})
    with pytest.raises(ConfigError, match=r"PDSDK_CONFIG transport.*warp"):
        config_from_env({"PDSDK_CONFIG": '{"transport": "warp"}'})
    with pytest.raises(ConfigError, match=r"PDSDK_CONFIG transport.*needs|moves pages"):
        config_from_env({"PDSDK_CONFIG": '{"transport": null}'})


def test_manager_refuses_a_bad_config_at_start(monkeypatch, plugins):
    from pdsdk.adapters.sglang.manager import PdsdkKVManager

    monkeypatch.setenv("PDSDK_CONFIG", '{"transport": "nixl", "timeouts": {"transfer_s": -1}}')
    with pytest.raises(ConfigError, match="timeouts.transfer_s"):
        PdsdkKVManager(object(), None, None)  # fails before touching SGLang's state or sockets


class _Args:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_layout_mha_and_bytes_fallback():
    mha = _Args(page_size=16, kv_item_lens=[2048] * 6, kv_cache_dtype_str="bfloat16", kv_head_num=2,
                total_kv_head_num=4)
    layout = layout_from_kv_args(mha, tp_size=2, tp_rank=1, is_mla=False)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.kv_split) == (3, 4, 32, True)
    assert layout.page_bytes == 2048
    mla = _Args(page_size=16, kv_item_lens=[16 * 576 * 2] * 4, kv_cache_dtype_str="bfloat16")
    fallback = layout_from_kv_args(mla, tp_size=1, tp_rank=0, is_mla=True)
    assert (fallback.dtype, fallback.num_layers, fallback.page_bytes) == ("uint8", 4, 16 * 576 * 2)
    other = layout_from_kv_args(_Args(**{**mla.__dict__, "page_size": 32, "kv_item_lens": [32 * 576 * 2] * 4}),
                                tp_size=1, tp_rank=0, is_mla=True)
    assert "page_size" in fallback.diff(other)


def test_transfer_spans_cover_every_buffer_and_the_metadata_row():
    local, remote = transfer_spans(np.array([3, 4]), np.array([9, 1]), [100, 200], aux=(2, 5), aux_item_lens=[8, 16])
    assert local.tolist() == [[0, 300, 100], [0, 400, 100], [1, 600, 200], [1, 800, 200], [2, 16, 8], [3, 32, 16]]
    assert remote.tolist() == [[0, 900, 100], [0, 100, 100], [1, 1800, 200], [1, 200, 200], [2, 40, 8], [3, 80, 16]]


def test_compat_reports_support():
    ok, detail = compat.support()
    assert ok and detail.startswith(compat.version())
    assert compat.kv_event_encoding("0.5.15.post1") == "array" and compat.kv_event_encoding("0.5.23") == "map"
    assert compat.sender_init_params()[:1] in (("req_has_disagg_prefill_dp_rank",), ("dest_tp_ranks",))
