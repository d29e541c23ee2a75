"""`pdsdk bench ...`: the benchmarks of pdsdk.bench, each registering its own subcommand."""

from __future__ import annotations

import importlib

from pdsdk.bench import BENCHES


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: JSON out (--json), a markdown row with --doc")
    bench_sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in BENCHES:
        importlib.import_module(f"pdsdk.bench.{name}").register(bench_sub)
