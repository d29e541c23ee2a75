"""`pdsdk plugins`: every registered transport, store and policy, and whether it loads here."""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pdsdk.plugins import KINDS, registry


def register(sub) -> None:
    p = sub.add_parser("plugins", help="list every transport, store and policy, built-in or third-party")
    p.add_argument("--kind", choices=KINDS, help="only this kind")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args) -> int:
    reg = registry()
    specs = [s for s in reg if args.kind in (None, s.kind)]
    if args.json:
        print(json.dumps([{"kind": s.kind, "name": s.name, "source": s.source, "extra": s.extra,
                           "target": s.target, "loadable": s.why_not is None, "why_not": s.why_not}
                          for s in specs], indent=2))
        return 0
    table = Table(title="pdsdk plugins")
    for column in ("kind", "name", "source", "extra", "status", "summary"):
        table.add_column(column, overflow="fold")
    for s in specs:
        why = s.why_not
        status = "[green]loadable[/]" if why is None else f"[yellow]{escape(why)}[/]"
        table.add_row(s.kind, s.name, escape(s.source), s.extra or "-", status, escape(s.summary))
    console = Console()
    console.print(table)
    if not specs:
        console.print("no plugins registered" + (f" of kind {args.kind}" if args.kind else ""))
    for name, error in reg.broken.items():
        console.print(f"[red]plugin {escape(name)} failed to load:[/] {escape(error)}")
    return 0
