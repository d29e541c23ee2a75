"""`pdsdk config check CONFIG`: validate a connector config and print it resolved."""

from __future__ import annotations

import json

from rich.console import Console
from rich.syntax import Syntax

from pdsdk.config import load_config


def register(sub) -> None:
    p = sub.add_parser("config", help="work with pdsdk connector configs")
    config_sub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = config_sub.add_parser("check", help="validate a config; print it resolved with its fingerprint")
    check.add_argument("config", help="JSON text, or @path to a .json/.yaml/.toml file")
    check.set_defaults(func=run_check)


def run_check(args) -> int:
    cfg = load_config(args.config)
    console = Console()
    console.print(Syntax(json.dumps(cfg.to_dict(), indent=2), "json", background_color="default"))
    console.print(f"fingerprint: {cfg.fingerprint()}")
    return 0
