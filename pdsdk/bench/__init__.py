"""`pdsdk bench ...`: one module per benchmark, each with `register(subparsers)`, listed in BENCHES.

transport, store, store_path (a vLLM-shaped cache through the connector's store path), connector (vLLM's
connectors end to end), serve (a load against any OpenAI server), router (+ router_peers, router_clients,
router_procs: pdsdk's router beside vllm-router and sglang-router). `log` writes JSON and, with `--doc`, a row
in a markdown table. Workers and clients they drive live in pdsdk.testing.
"""

BENCHES = ("transport", "store", "router", "connector", "store_path", "serve")
