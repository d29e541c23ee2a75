"""Registers the store `example_dict` through pdsdk's hooks, exactly as a real plugin would."""

import pdsdk


@pdsdk.hookimpl
def pdsdk_add_stores(registrar):
    registrar.add("example_dict", "pdsdk_example_plugin.store:DictStore",
                  summary="unbounded in-process dict (example plugin)")
