"""Engine mounts: vLLM (KVConnectorBase_V1) and SGLang (transfer backend, HiCache storage).
Engine imports live only here and in compat/."""
