"""The pdsdk plugin contract (pluggy project "pdsdk", entry-point group "pdsdk").

This module is the API. A plugin is any module or object with functions marked
`@pdsdk.hookimpl` and named like the hooks below; a third-party package exposes it under
the entry-point group `pdsdk`::

    [project.entry-points.pdsdk]
    my_store = "my_package.pdsdk_plugin"

Built-in transports, stores and policies register through these same hooks.

Registration hooks receive a `Registrar` bound to one kind. `registrar.add(name, target, ...)`
records a lazy factory: `target` is "module:attribute", imported only when the plugin is used,
so listing plugins never imports an optional library.

Observation hooks are called after the fact, from whichever thread did the work; they must be
quick and must not raise (an exception is logged and dropped, never reaches the engine).
"""

from __future__ import annotations

import pluggy

PROJECT = "pdsdk"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- registration ---------------------------------------------------------------------------

@hookspec
def pdsdk_add_transports(registrar):
    """Register L2 KV transports.

    Call ``registrar.add(name, "pkg.module:Class", extra="nixl", requires=("nixl",), summary=...)``.
    The class implements `pdsdk.connectors.transports.base.Transport` and is constructed as
    ``Class(name=name, layout=layout, **options)`` when a config selects it.
    """


@hookspec
def pdsdk_add_stores(registrar):
    """Register L3 KV stores.

    Call ``registrar.add(name, "pkg.module:Class", extra=..., requires=(...), summary=...)``.
    The class implements `pdsdk.connectors.stores.base.Store` and is constructed as
    ``Class(name=name, **options)`` when a config selects it.
    """


@hookspec
def pdsdk_add_policies(registrar):
    """Register L5 routing policies.

    Call ``registrar.add(name, "pkg.module:Class", summary=...)``. The class implements
    the router's policy contract (`pdsdk.router.policies.Policy`).
    """


# --- observation ----------------------------------------------------------------------------

@hookspec
def pdsdk_transfer_started(transport, transfer_id, peer, nbytes, spans):
    """A transfer was posted.

    transport: registered name; transfer_id: unique string; peer: peer name;
    nbytes: bytes to move; spans: descriptors after coalescing.
    """


@hookspec
def pdsdk_transfer_finished(transport, transfer_id, peer, nbytes, seconds, path):
    """A transfer completed and its bytes are in place.

    seconds: wall time from post to completion; path: what actually carried it
    (e.g. "ucx:cma", "mooncake:tcp", "gloo", "shm"), as in the transport's stats().
    """


@hookspec
def pdsdk_transfer_failed(transport, transfer_id, peer, reason):
    """A transfer failed or passed its deadline; reason is a human-readable string."""


@hookspec
def pdsdk_store_hit(store, pages, nbytes):
    """A get found `pages` pages (`nbytes` bytes) in store `store`."""


@hookspec
def pdsdk_store_miss(store, pages):
    """A get or contains missed `pages` pages in store `store`."""


@hookspec
def pdsdk_store_evict(store, pages, nbytes, reason):
    """Store `store` evicted (or demoted) pages; reason: "capacity", "ttl", "delete", ..."""


@hookspec
def pdsdk_route_decision(policy, request_id, role, worker, reason):
    """The router sent request `request_id` to `worker` as `role` ("prefill", "decode", "plain")
    because of `reason` (e.g. "prefix-hit 12/16 pages", "least-load")."""
