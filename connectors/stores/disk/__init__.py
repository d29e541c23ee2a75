"""`disk`: pages in append-only segment files under a directory; see store.py."""
