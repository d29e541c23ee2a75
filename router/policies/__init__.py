"""Routing policies: the contract (base.py) and the built-in ones, registered in pdsdk/router/__init__.py."""

from pdsdk.router.policies.base import Choice, NoWorker, Policy, RouteRequest, WorkerView, build_policy

__all__ = ["Choice", "NoWorker", "Policy", "RouteRequest", "WorkerView", "build_policy"]
