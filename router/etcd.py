"""Worker discovery through etcd, over etcd's v3 HTTP/JSON gateway (no extra client library).

A worker (or a sidecar next to it) registers `PREFIX<role>/<url>` -> JSON record under a lease and
keeps the lease alive; when it stops or dies, the lease expires and etcd deletes the key. The
router lists the prefix, then watches it, adding and removing workers as keys come and go.
Record: {"url", "role", "bootstrap_port", "kv_events", "kv_replay"}.

Sidecar: python -m pdsdk.router.etcd --etcd http://E:2379 --url http://me:8000 --role decode
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
from typing import Any

import aiohttp

from pdsdk.errors import ConfigError
from pdsdk.router.workers import Worker

log = logging.getLogger(__name__)


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _unb64(s: str) -> str:
    return base64.b64decode(s).decode()


def _range_end(prefix: str) -> str:
    b = bytearray(prefix.encode())
    b[-1] += 1
    return base64.b64encode(bytes(b)).decode()


async def _post(session: aiohttp.ClientSession, base: str, path: str, body: dict, timeout: float = 5.0) -> dict:
    async with session.post(f"{base.rstrip('/')}{path}", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"etcd {path}: HTTP {r.status}: {data}")
        return data


def _worker(value: str) -> Worker:
    rec = json.loads(value)
    if not isinstance(rec, dict):
        raise ValueError("a worker record must be a JSON object")
    return Worker(rec["url"], role=rec.get("role", "plain"), bootstrap_port=rec.get("bootstrap_port"),
                  kv_events=rec.get("kv_events"), kv_replay=rec.get("kv_replay"), source="etcd")


async def watch_workers(router, etcd: str, prefix: str, retry_s: float = 1.0) -> None:
    """Keep the router's pool in step with the records under `prefix` (runs until cancelled)."""
    keys: dict[str, str] = {}  # etcd key -> worker url
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                got = await _post(session, etcd, "/v3/kv/range", {"key": _b64(prefix), "range_end": _range_end(prefix)})
                rev = int(got["header"]["revision"])
                seen = {}
                for kv in got.get("kvs", []):
                    seen[_unb64(kv["key"])] = _unb64(kv["value"])
                for key in set(keys) - set(seen):  # deleted while we were not watching
                    router.pool.remove(keys.pop(key))
                for key, value in seen.items():
                    _apply(router, keys, key, value)
                await _watch(router, session, etcd, prefix, rev + 1, keys)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - etcd down or restarting: keep trying
                log.warning("etcd %s: %s; retrying in %.0f s", etcd, e, retry_s)
            await asyncio.sleep(retry_s)


def _apply(router, keys: dict[str, str], key: str, value: str | None) -> None:
    if value is None:
        url = keys.pop(key, None)
        if url:
            router.pool.remove(url)
        return
    try:
        w = _worker(value)
    except (ValueError, KeyError, RecursionError, ConfigError) as e:
        log.warning("etcd record %s ignored: %s", key, e)
        return
    if (w.role == "plain") == router.cfg.pd:
        log.warning("etcd record %s ignored: role %s does not fit this router", key, w.role)
        return
    keys[key] = w.url
    router.add_worker(w)


async def _watch(router, session, etcd: str, prefix: str, start_rev: int, keys: dict[str, str]) -> None:
    body = {"create_request": {"key": _b64(prefix), "range_end": _range_end(prefix), "start_revision": start_rev}}
    async with session.post(f"{etcd.rstrip('/')}/v3/watch", json=body,
                            timeout=aiohttp.ClientTimeout(total=None, sock_read=None)) as r:
        if r.status != 200:
            raise RuntimeError(f"etcd watch: HTTP {r.status}")
        async for line in r.content:  # one JSON message per line
            if not line.strip():
                continue
            msg = json.loads(line)
            if "error" in msg:
                raise RuntimeError(f"etcd watch: {msg['error']}")
            for ev in msg.get("result", {}).get("events", []):
                key = _unb64(ev["kv"]["key"])
                _apply(router, keys, key, None if ev.get("type") == "DELETE" else _unb64(ev["kv"].get("value", "")))
    raise RuntimeError("etcd watch stream ended")


class Registration:
    """Register one worker under a lease and keep it alive; `stop()` revokes it (key deleted)."""

    def __init__(self, etcd: str, record: dict[str, Any], prefix: str = "/pdsdk/workers/", ttl_s: int = 10):
        self.etcd, self.record, self.ttl_s = etcd, record, ttl_s
        self.key = f"{prefix}{record.get('role', 'plain')}/{record['url']}"
        self.lease: str | None = None
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> Registration:
        self._session = aiohttp.ClientSession()
        await self._register()
        self._task = asyncio.ensure_future(self._keepalive())
        return self

    async def _register(self) -> None:
        got = await _post(self._session, self.etcd, "/v3/lease/grant", {"TTL": self.ttl_s})
        self.lease = got["ID"]
        await _post(self._session, self.etcd, "/v3/kv/put",
                    {"key": _b64(self.key), "value": _b64(json.dumps(self.record)), "lease": self.lease})

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                got = await _post(self._session, self.etcd, "/v3/lease/keepalive", {"ID": self.lease})
                if int(got.get("result", {}).get("TTL", 0)) <= 0:  # lease lost (etcd restarted?)
                    await self._register()
            except Exception as e:  # noqa: BLE001 - keep trying; the lease may still be alive
                log.warning("etcd keepalive: %s", e)

    async def stop(self, revoke: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if revoke and self.lease is not None:
            try:
                await _post(self._session, self.etcd, "/v3/lease/revoke", {"ID": self.lease})
            except Exception as e:  # noqa: BLE001 - it will expire on its own
                log.warning("etcd revoke: %s", e)
        if self._session is not None:
            await self._session.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="register a worker with the pdsdk router through etcd")
    ap.add_argument("--etcd", required=True, help="etcd URL, e.g. http://127.0.0.1:2379")
    ap.add_argument("--url", required=True, help="the worker's HTTP URL as the router should reach it")
    ap.add_argument("--role", default="plain", choices=("plain", "prefill", "decode"), help="worker role")
    ap.add_argument("--bootstrap-port", type=int, help="SGLang prefill: its bootstrap port")
    ap.add_argument("--kv-events", help="its ZMQ KV event endpoint(s)")
    ap.add_argument("--kv-replay", help="its KV event replay endpoint(s)")
    ap.add_argument("--prefix", default="/pdsdk/workers/", help="key prefix (the router's --etcd-prefix)")
    ap.add_argument("--ttl", type=int, default=10, help="lease TTL in seconds (default 10)")
    args = ap.parse_args(argv)
    record = {"url": args.url, "role": args.role, "bootstrap_port": args.bootstrap_port,
              "kv_events": args.kv_events, "kv_replay": args.kv_replay}

    async def run() -> None:
        reg = await Registration(args.etcd, record, args.prefix, args.ttl).start()
        print(f"registered {reg.key} (lease {reg.lease}, ttl {args.ttl} s)", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await reg.stop()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
