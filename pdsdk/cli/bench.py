"""`pdsdk bench ...`: each benchmark is a module with `register(subparsers)`, listed in BENCHES."""

from __future__ import annotations

import importlib

BENCHES = ("pdsdk.connectors.transports.bench", "pdsdk.connectors.stores.bench", "pdsdk.router.bench",
           "pdsdk.adapters.vllm.bench", "pdsdk.adapters.common.bench", "pdsdk.matrix.bench")


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: JSON out, a row in docs/benchmarks.md")
    bench_sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for module in BENCHES:
        importlib.import_module(module).register(bench_sub)
