"""`pdsdk bench ...`: each benchmark is a module with `register(subparsers)`, listed in BENCHES."""

from __future__ import annotations

import importlib

BENCHES = ("pdsdk.bench.transport", "pdsdk.bench.store", "pdsdk.bench.router",
           "pdsdk.bench.connector", "pdsdk.bench.store_path", "pdsdk.bench.serve")


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: JSON out (--json), a markdown row with --doc")
    bench_sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for module in BENCHES:
        importlib.import_module(module).register(bench_sub)
