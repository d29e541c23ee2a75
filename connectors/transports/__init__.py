"""L2 KV transports. Built-ins register here through the same hook as third-party transports."""

from pdsdk.hookspecs import hookimpl

# name -> (module:class, extra, required modules, summary); imported only when used.
BUILTIN_TRANSPORTS: dict[str, tuple[str, str | None, tuple[str, ...], str]] = {
    "nixl": ("pdsdk.connectors.transports.nixl:NixlTransport", "nixl", ("nixl",),
             "NVIDIA NIXL over UCX (cma/tcp on host, cuda_ipc/NVLink, RDMA)"),
    "mooncake": ("pdsdk.connectors.transports.mooncake:MooncakeTransport", "mooncake", ("mooncake",),
                 "Mooncake Transfer Engine, P2P handshake (tcp; rdma/nvlink when asked and present)"),
    "local": ("pdsdk.connectors.transports.local.transport:LocalTransport", None, (),
              "same host: one-copy cross-memory attach (CPU), CUDA IPC (GPU)"),
    "nccl": ("pdsdk.connectors.transports.nccl.transport:NcclTransport", "nccl", ("torch",),
             "torch.distributed pair groups: NCCL on GPU, gloo on CPU"),
    "fake": ("pdsdk.connectors.transports.fake:FakeTransport", None, (),
             "peers in one process, memcpy (or bytes dropped): tests, and the template for a new transport"),
}


@hookimpl
def pdsdk_add_transports(registrar):
    for name, (target, extra, requires, summary) in BUILTIN_TRANSPORTS.items():
        registrar.add(name, target, extra=extra, requires=requires, summary=summary)
