"""pdsdk.testing: the public test kit (like pytest's pytester), kept apart from the product.

- fake_worker: an OpenAI-compatible worker with vLLM's and SGLang's PD request semantics and settable faults;
- lean_worker: a lean streaming worker and load client, cheap enough to measure a router beside them;
- router_harness: a router with fake workers in one event loop;
- fake_kv_events: a KV event publisher in the engines' wire formats, with replay and dropped messages;
- peer: the other side of a transfer, for transport tests and benches;
- servers: redis-server and mooncake_master on free loopback ports (start, kill, restart);
- faults: `corrupt_reads`, a transport that damages what it reads; plugins: `plugin_env`, which registers
  a plugin module in the processes a test starts.
The benches and `pdsdk matrix` use them; the serving path never imports this package.
"""
