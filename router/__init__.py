"""L5 router: policies, KV index, PD orchestration and the HTTP proxy."""

from pdsdk.hookspecs import hookimpl

# name -> (module:class, summary); imported only when used.
BUILTIN_POLICIES: dict[str, tuple[str, str]] = {
    "round_robin": ("pdsdk.router.policies.basic:RoundRobin", "each worker in turn"),
    "random": ("pdsdk.router.policies.basic:Random", "uniform random worker"),
    "least_load": ("pdsdk.router.policies.basic:LeastLoad", "fewest requests in flight"),
    "power_of_two": ("pdsdk.router.policies.basic:PowerOfTwo", "less loaded of two random workers"),
    "session": ("pdsdk.router.policies.session:Session", "sticky worker per session id (L6 hint)"),
    "prefix": ("pdsdk.router.policies.prefix:Prefix",
               "approximate radix tree of prompts sent, with a load-balance guard"),
    "kv_events": ("pdsdk.router.policies.kv_events:KVEvents",
                  "exact KV block index from the engines' ZMQ event streams"),
}


@hookimpl
def pdsdk_add_policies(registrar):
    for name, (target, summary) in BUILTIN_POLICIES.items():
        registrar.add(name, target, summary=summary)
