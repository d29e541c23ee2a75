"""`pdsdk launch --engine sglang --dry-run`: every worker line parses with SGLang's own parser."""

import argparse
import shlex
import subprocess
import sys

import pytest

from pdsdk.compat import sglang as compat


@pytest.mark.skipif(not compat.at_least("0.5.16"), reason="SGLang 0.5.15 loads the model config and probes the "
                    "device while building ServerArgs; test_plugin.py parses the builder's flags there")
def test_dry_run_flags_parse_with_sglangs_parser():
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()  # adds the pdsdk backend to SGLang's choices, as every SGLang process does

    out = subprocess.run([sys.executable, "-P", "-m", "pdsdk", "launch", "--engine", "sglang", "--model", "/m/qwen",
                          "--transport", "nixl", "--prefill", "1", "--decode", "2", "--gpus", "0,1,2", "--dry-run"],
                         capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    workers = [shlex.split(line) for line in out.stdout.splitlines() if "sglang.launch_server" in line]
    assert len(workers) == 3
    modes = []
    for argv in workers:
        env = dict(a.split("=", 1) for a in argv if "=" in a and a.split("=", 1)[0].isupper())
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        args = ServerArgs.from_cli_args(parser.parse_args(argv[argv.index("sglang.launch_server") + 1:]))
        modes.append(args.disaggregation_mode)
        assert args.disaggregation_transfer_backend == "pdsdk" and "PDSDK_CONFIG" in env
        if args.disaggregation_mode == "prefill":
            assert args.disaggregation_bootstrap_port == int(env["PDSDK_BOOTSTRAP_PORT"])
    assert modes == ["prefill", "decode", "decode"]
    router = next(line for line in out.stdout.splitlines() if "-m pdsdk router" in line)
    assert "--engine sglang" in router and router.count("--decode") == 2
