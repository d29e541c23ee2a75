"""L5 router: policies, KV index, PD orchestration and the HTTP proxy."""

from pdsdk.hookspecs import hookimpl

# name -> (module:class, summary); imported only when used.
BUILTIN_POLICIES: dict[str, tuple[str, str]] = {}


@hookimpl
def pdsdk_add_policies(registrar):
    for name, (target, summary) in BUILTIN_POLICIES.items():
        registrar.add(name, target, summary=summary)
