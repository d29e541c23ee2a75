"""`redis`: pages in a redis-server that several engines share (redis-py, pipelined batches).

An outage never reaches the engine: a failed call counts an error and answers misses, and later
calls are answered locally (misses, nothing stored) until a reconnect attempt is due, with
exponential backoff; redis-py reconnects by itself on that attempt.

Eviction is the server's. Run it with `maxmemory` and `maxmemory-policy volatile-lru`: every
page gets an expiry (its ttl_s, else `default_ttl_s`) except pinned pages without a ttl_s, so the
server never evicts those. Priority and keep=False are not enforced here (the server's LRU is).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdsdk.connectors.stores.base import Backoff, Buffer, Hints, Store, byte_view, log

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
            self._record_error()
            return default
        except redis.RedisError as e:  # the server answered with an error (e.g. OOM): it is up
            log.warning("%s: %s failed: %s", self.name, what, e)
            self._backoff.succeeded()
            self._record_error()
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
                pipe.set(self._key(key), view, px=px)
            return pipe.execute(raise_on_error=False)

        results = self._call("put", run, [])
        stored = next((i for i, r in enumerate(results) if r is not True), len(results))
        if stored < len(results):
            self._record_error()
            log.warning("%s: put stored %d of %d pages: %s", self.name, stored, len(results), results[stored])
        self._record_put(stored, sum(len(v) for v in views[:stored]))
        return stored

    def get(self, keys: Sequence[bytes], out: Sequence[Buffer]) -> int:
        values = self._call("get", lambda: self._client.mget([self._key(k) for k in keys]), []) if keys else []
        hits = nbytes = 0
        for value, buf in zip(values, out):
            if value is None:
                break
            view = byte_view(buf)
            if len(value) > len(view):
                log.warning("%s: page of %d bytes does not fit a %d-byte buffer", self.name, len(value), len(view))
                break
            view[: len(value)] = value
            hits, nbytes = hits + 1, nbytes + len(value)
        self._record_get(hits, len(keys), nbytes)
        return hits

    def contains(self, keys: Sequence[bytes]) -> int:
        def run():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._key(key))
            return pipe.execute()

        found = self._call("contains", run, []) if keys else []
        return next((i for i, n in enumerate(found) if not n), len(found))

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
