"""L3 KV stores. Built-ins register here through the same hook as third-party stores."""

from pdsdk.hookspecs import hookimpl

# name -> (module:class, extra, required modules, summary); imported only when used.
BUILTIN_STORES: dict[str, tuple[str, str | None, tuple[str, ...], str]] = {}


@hookimpl
def pdsdk_add_stores(registrar):
    for name, (target, extra, requires, summary) in BUILTIN_STORES.items():
        registrar.add(name, target, extra=extra, requires=requires, summary=summary)
