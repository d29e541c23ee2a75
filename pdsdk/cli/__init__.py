"""The `pdsdk` command. Each subcommand lives in its own module with `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from pdsdk._version import __version__
from pdsdk.errors import PdsdkError

# Subcommand modules, imported on start-up: each must stay cheap to import.
COMMANDS = ("pdsdk.cli.plugins", "pdsdk.cli.config", "pdsdk.cli.doctor", "pdsdk.cli.bench", "pdsdk.cli.model",
            "pdsdk.cli.router", "pdsdk.cli.launch", "pdsdk.cli.matrix",
            "pdsdk.demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdsdk", description="Pluggable parts for prefill/decode disaggregated serving on vLLM and SGLang.")
    parser.add_argument("--version", action="version", version=f"pdsdk {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except PdsdkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
