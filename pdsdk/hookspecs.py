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

from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:  # type names only: this module is imported by `import pdsdk`, which stays light
    from pdsdk import KVLayout, Policy, Store, Transport
    from pdsdk.plugins import Registrar

PROJECT = "pdsdk"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- what a registered target is called with ------------------------------------------------

class TransportFactory(Protocol):
    """A transport class, called by `pdsdk.open_transport` (adapters, benches, test drivers)."""

    def __call__(self, *, name: str, layout: KVLayout, host: str, transfer_timeout_s: float,
                 connect_timeout_s: float, **options: Any) -> Transport:
        """name: the registered name; layout: this side's KV layout (peers must match it); host: the
        address peers reach this side at; transfer_timeout_s: a transfer's deadline, post to
        completion; connect_timeout_s: bounds a handshake; options: the config's, checked against
        the class's OPTIONS."""


class StoreFactory(Protocol):
    """A store class or function, called by `pdsdk.open_store`."""

    def __call__(self, *, name: str, **options: Any) -> Store:
        """options: the config's, checked against the factory's keyword parameters (a tiered store
        also gets `tiers`, its store specs)."""


class PolicyFactory(Protocol):
    """A policy class, called by the router's `build_policy`."""

    def __call__(self, *, name: str, **options: Any) -> Policy: ...


# --- registration ---------------------------------------------------------------------------

@hookspec
def pdsdk_add_transports(registrar: Registrar) -> None:
    """Register L2 KV transports.

    Call ``registrar.add(name, "pkg.module:Class", extra="nixl", requires=("nixl",), summary=...)``.
    The class subclasses `pdsdk.Transport` and is called as a `TransportFactory`.
    """


@hookspec
def pdsdk_add_stores(registrar: Registrar) -> None:
    """Register L3 KV stores.

    Call ``registrar.add(name, "pkg.module:Class", extra=..., requires=(...), summary=...)``.
    The class subclasses `pdsdk.Store` and is called as a `StoreFactory`.
    """


@hookspec
def pdsdk_add_policies(registrar: Registrar) -> None:
    """Register L5 routing policies.

    Call ``registrar.add(name, "pkg.module:Class", summary=...)``. The class subclasses
    `pdsdk.Policy` and is called as a `PolicyFactory`.
    """


# --- observation ----------------------------------------------------------------------------

@hookspec
def pdsdk_transfer_started(transport: str, transfer_id: str, peer: str, nbytes: int, spans: int) -> None:
    """A transfer was posted.

    transport: registered name; transfer_id: unique string; peer: peer name;
    nbytes: bytes to move; spans: descriptors after coalescing.
    """


@hookspec
def pdsdk_transfer_finished(transport: str, transfer_id: str, peer: str, nbytes: int, seconds: float,
                            path: str) -> None:
    """A transfer completed and its bytes are in place.

    seconds: wall time from post to completion; path: what actually carried it
    (e.g. "ucx:cma", "mooncake:tcp", "gloo", "shm"), as in the transport's stats().
    """


@hookspec
def pdsdk_transfer_failed(transport: str, transfer_id: str, peer: str, reason: str) -> None:
    """A transfer failed or passed its deadline; reason is a human-readable string."""


@hookspec
def pdsdk_store_hit(store: str, pages: int, nbytes: int) -> None:
    """A get found `pages` pages (`nbytes` bytes) in store `store`."""


@hookspec
def pdsdk_store_miss(store: str, pages: int) -> None:
    """A get or contains missed `pages` pages in store `store`."""


@hookspec
def pdsdk_store_evict(store: str, pages: int, nbytes: int, reason: str) -> None:
    """Store `store` evicted (or demoted) pages; reason: "capacity", "ttl", "delete", ..."""


@hookspec
def pdsdk_route_decision(policy: str, request_id: str, role: str, worker: str, reason: str) -> None:
    """The router sent request `request_id` to `worker` as `role` ("prefill", "decode", "plain")
    because of `reason` (e.g. "prefix-hit 12/16 pages", "least-load")."""
