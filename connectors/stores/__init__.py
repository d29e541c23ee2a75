"""L3 KV stores. Built-ins register here through the same hook as third-party stores."""

from pdsdk.hookspecs import hookimpl

# name -> (module:class, extra, required modules, summary); imported only when used.
BUILTIN_STORES: dict[str, tuple[str, str | None, tuple[str, ...], str]] = {
    "memory": ("pdsdk.connectors.stores.memory:MemoryStore", None, (),
               "pages in process RAM, byte-bounded, hint-aware LRU"),
    "disk": ("pdsdk.connectors.stores.disk.store:DiskStore", None, (),
             "pages appended to segment files under a directory, checksummed, survives restarts"),
    "redis": ("pdsdk.connectors.stores.redis:RedisStore", "redis", ("redis", "xxhash"),
              "a shared redis-server; pipelined batches, misses and backoff on outages"),
    "mooncake": ("pdsdk.connectors.stores.mooncake:MooncakeStore", "mooncake", ("mooncake", "xxhash"),
                 "Mooncake Store: a distributed pool with mooncake_master"),
    # requires=(): the store also works through a worker in another venv (.venv/lmcache), so
    # LMCache need not be importable here; the store says at construction if it is nowhere.
    "lmcache": ("pdsdk.connectors.stores.lmcache.store:LMCacheStore", "lmcache", (),
                "LMCache's storage manager, in process or in a worker from an LMCache venv"),
    "tiered": ("pdsdk.connectors.stores.tiered:TieredStore", None, (),
               "ordered stores, fastest first: reads promote, evictions demote"),
}


@hookimpl
def pdsdk_add_stores(registrar):
    for name, (target, extra, requires, summary) in BUILTIN_STORES.items():
        registrar.add(name, target, extra=extra, requires=requires, summary=summary)
