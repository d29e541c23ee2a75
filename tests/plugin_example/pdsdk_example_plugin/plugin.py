"""Registers the store `example_dict` and the transport `example_procmem` through pdsdk's hooks,
exactly as a real plugin would."""

import pdsdk


@pdsdk.hookimpl
def pdsdk_add_stores(registrar):
    registrar.add("example_dict", "pdsdk_example_plugin.store:DictStore",
                  summary="unbounded in-process dict (example plugin)")


@pdsdk.hookimpl
def pdsdk_add_transports(registrar):
    registrar.add("example_procmem", "pdsdk_example_plugin.transport:ProcMemTransport",
                  summary="processes of one host through /proc/<pid>/mem (example plugin)")
