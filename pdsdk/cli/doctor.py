"""`pdsdk doctor`: engines, versions, transports and servers found here, and how to get the rest."""

from __future__ import annotations

import json
from dataclasses import asdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

STYLE = {"ok": "green", "missing": "yellow", "warn": "yellow", "error": "red"}


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check Python, torch/GPUs, vLLM, SGLang, NIXL/UCX, Mooncake, redis, etcd")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--strict", action="store_true", help="exit 1 if anything is missing or broken")
    p.set_defaults(func=run)


def run(args) -> int:
    from pdsdk.compat.doctor import OK, run_checks

    console = Console()
    with console.status("probing engines and libraries..."):
        checks = run_checks()
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        table = Table(title="pdsdk doctor")
        for column in ("component", "status", "detail", "fix"):
            table.add_column(column, overflow="fold")
        for c in checks:
            table.add_row(c.component, f"[{STYLE[c.status]}]{c.status}[/]", escape(c.detail), escape(c.fix))
        console.print(table)
    return 1 if args.strict and any(c.status != OK for c in checks) else 0
