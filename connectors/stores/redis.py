"""`redis`: pages in a redis-server that several engines share (redis-py, pipelined batches).

An outage never reaches the engine: a failed call counts an error and answers misses, and later
calls are answered locally (misses, nothing stored) until a reconnect attempt is due, with
exponential backoff; redis-py reconnects by itself on that attempt.

Eviction is the server's. Run it with `maxmemory` and `maxmemory-policy volatile-lru`: every
page gets an expiry (its ttl_s, else `default_ttl_s`) except pinned pages without a ttl_s, so the
server never evicts those. Priority and keep=False are not enforced here (the server's LRU is).

Values are common/remote_record.py's records: a header (length, checksum) before the page. `get` reads at
most one byte more than the buffer holds and checks the record (a page exactly the buffer's size);
`contains` checks that the key holds a string whose length is the one its header declares. A bad
value (wrong type, length or checksum) is a miss for both, and `get` deletes it and counts an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdsdk.connectors.stores.base import Buffer, Hints, Store, byte_view, copy_into, log
from pdsdk.connectors.stores.common.backoff import Backoff
from pdsdk.connectors.stores.common.remote_record import HEADER_SIZE, declared_length, flaw, seal

_DOWN = (redis.ConnectionError, redis.TimeoutError)


class RedisStore(Store):
    def __init__(self, name: str = "redis", url: str = "redis://127.0.0.1:6379/0", prefix: str = "pdsdk:",
                 timeout_s: float = 1.0, default_ttl_s: float = 7 * 86400, backoff_max_s: float = 5.0):
        super().__init__(name)
        self.url, self.prefix = url, prefix.encode()
        self.default_ttl_s = default_ttl_s
        # No retries inside redis-py: our backoff decides when to try again, so a dead server
        # costs one timeout, then nothing until the next attempt is due.
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._backoff = Backoff(max_s=backoff_max_s)

    def _key(self, key: bytes) -> bytes:
        return self.prefix + bytes(key)

    def _call(self, what: str, fn: Callable[[], Any], default: Any) -> Any:
        if not self._backoff.ready():
            return default
        try:
            result = fn()
        except _DOWN as e:
            if not self._backoff.down:
                log.warning("%s: %s unreachable (%s); answering misses, reconnecting with backoff",
                            self.name, self.url, e)
            self._backoff.failed()
            self.record_error()
            return default
        except redis.RedisError as e:  # the server answered with an error (e.g. OOM): it is up
            log.warning("%s: %s failed: %s", self.name, what, e)
            self._backoff.succeeded()
            self.record_error()
            return default
        if self._backoff.down:
            log.info("%s: %s reachable again", self.name, self.url)
        self._backoff.succeeded()
        return result

    def put(self, keys: Sequence[bytes], pages: Sequence[Buffer], hints: Hints | None = None) -> int:
        hints = hints or Hints()
        ttl = hints.ttl_s if hints.ttl_s is not None else (None if hints.pin else self.default_ttl_s)
        px = max(1, int(ttl * 1000)) if ttl is not None else None
        views = [byte_view(p) for p in pages[: len(keys)]]

        def run():
            pipe = self._client.pipeline(transaction=False)
            for key, view in zip(keys, views):
                pipe.set(self._key(key), seal(key, view) + view, px=px)
            return pipe.execute(raise_on_error=False)

        results = self._call("put", run, [])
        stored = next((i for i, r in enumerate(results) if r is not True), len(results))
        if stored < len(results):
            self.record_error()
            log.warning("%s: put stored %d of %d pages: %s", self.name, stored, len(results), results[stored])
        self.record_put(stored, sum(len(v) for v in views[:stored]))
        return stored

    def get(self, keys: Sequence[bytes], out: Sequence[Buffer]) -> int:
        keys = [bytes(k) for k in keys]
        views = [byte_view(b) for b in out[: len(keys)]]

        def run():
            pipe = self._client.pipeline(transaction=False)
            for key, view in zip(keys, views):
                # one byte past what fits: a longer value is not fetched whole
                pipe.getrange(self._key(key), 0, HEADER_SIZE + len(view))
            return pipe.execute(raise_on_error=False)

        values = self._call("get", run, []) if views else []
        hits = nbytes = 0
        for key, value, view in zip(keys, values, views):
            if value == b"":  # absent
                break
            payload = memoryview(value)[HEADER_SIZE:] if isinstance(value, bytes) else b""
            why = f"holds no string ({value})" if isinstance(value, Exception) else flaw(key, value, payload, len(view))
            if why is not None:
                self._drop_bad(key, why)
                break
            copy_into(view, payload)
            hits, nbytes = hits + 1, nbytes + len(payload)
        self.record_get(hits, len(keys), nbytes)
        return hits

    def _drop_bad(self, key: bytes, why: str) -> None:
        log.warning("%s: page %s %s; treated as a miss and deleted", self.name, key.hex()[-16:], why)
        self.record_error()
        self._call("delete", lambda: self._client.unlink(self._key(key)), 0)

    def contains(self, keys: Sequence[bytes]) -> int:
        def run():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.strlen(self._key(key))
                pipe.getrange(self._key(key), 0, HEADER_SIZE - 1)
            return pipe.execute(raise_on_error=False)

        found = self._call("contains", run, []) if keys else []
        n = 0
        for size, head in zip(found[::2], found[1::2]):  # errors: a key holding another redis type
            length = declared_length(head) if isinstance(head, bytes) else None
            if length is None or size != HEADER_SIZE + length:
                break
            n += 1
        return n

    def delete(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        return self._call("delete", lambda: self._client.unlink(*[self._key(k) for k in keys]), 0)

    def stats(self) -> dict:
        info = self._call("stats", lambda: self._client.info("memory") | self._client.info("stats"), {})
        server = {k: info[k] for k in ("used_memory", "maxmemory", "evicted_keys") if k in info}
        return {**super().stats(), "reachable": not self._backoff.down, **{f"server_{k}": v for k, v in server.items()}}

    def close(self) -> None:
        try:
            self._client.close()
        except redis.RedisError:
            pass
