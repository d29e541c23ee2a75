"""`lmcache`: pages in LMCache's storage manager, in process or in a worker; see store.py."""
