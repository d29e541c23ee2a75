"""Old path of pdsdk.testing.fake_kv_events, kept for router/bench.py until it imports the new one."""

from pdsdk.testing.fake_kv_events import chain, encode_batch, stored  # noqa: F401
