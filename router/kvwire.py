"""Old path of pdsdk.router.kvindex.wire, kept for router/bench.py until it imports the new one."""

from pdsdk.router.kvindex.wire import decode_batch  # noqa: F401
