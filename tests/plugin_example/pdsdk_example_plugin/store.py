"""An unbounded dict store: the least a store must do to pass pdsdk's conformance suite."""

import threading

from pdsdk import Store


class DictStore(Store):
    def __init__(self, name: str = "example_dict"):
        super().__init__(name)
        self._pages: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def put(self, keys, pages, hints=None):
        with self._lock:
            for key, page in zip(keys, pages):
                self._pages[bytes(key)] = bytes(memoryview(page).cast("B"))
        self.record_put(len(keys), sum(memoryview(p).nbytes for p in pages))
        return len(keys)

    def get(self, keys, out):
        hits = nbytes = 0
        with self._lock:
            for key, buf in zip(keys, out):
                page = self._pages.get(bytes(key))
                if page is None:
                    break
                memoryview(buf).cast("B")[: len(page)] = page
                hits, nbytes = hits + 1, nbytes + len(page)
        self.record_get(hits, len(keys), nbytes)
        return hits

    def contains(self, keys):
        with self._lock:
            return next((i for i, k in enumerate(keys) if bytes(k) not in self._pages), len(keys))

    def delete(self, keys):
        with self._lock:
            return sum(self._pages.pop(bytes(k), None) is not None for k in keys)
