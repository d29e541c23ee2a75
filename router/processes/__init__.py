"""`pdsdk router --processes N`: N processes serve one port, each with the whole request path.

- parent.py: the process `pdsdk router` starts. It starts the serving processes (child.py),
  restarts one that dies, and on SIGTERM stops them all; it serves no request itself.
- primary.py (in the parent): the one worker set, as a single-process router keeps it (static
  list, admin changes, etcd, one health checker), published to every process as numbered snapshots.
- link.py (in each serving process): mirrors the snapshots into its pool and forwards admin
  changes to the primary.
- load_table.py: requests in flight and breaker states per worker, in memory all processes map.
- messages.py: what crosses the local sockets (msgpack, typed).
Each serving process keeps its own policy state (the kv_events index subscribes to the engines'
streams itself); its counters go to prometheus_client's multiprocess files, summed by any scrape.
"""
