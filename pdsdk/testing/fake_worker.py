"""A small OpenAI-compatible worker that follows vLLM's and SGLang's PD request semantics, for the
router's tests and bench (no model: it answers "tok0 tok1 ..."). Faults are attributes to set.

vLLM: a body with kv_transfer_params.do_remote_decode is a prefill (must be max_tokens 1, not
streamed); it answers with kv_transfer_params naming itself, like NixlConnector. A body with
do_remote_prefill is a decode; it checks the params came from a prefill of the same X-Request-Id.
SGLang (role prefill/decode): needs bootstrap_host/port/room; decode waits until the prefill
with the same room has arrived (standing in for the KV transfer), and fails after a timeout.
Run alone: python -m pdsdk.testing.fake_worker --port P [--engine vllm] [--role plain] [--chunks N].
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

ROOMS: dict[int, asyncio.Event] = {}  # SGLang rooms seen by in-process prefill workers
ISSUED: dict[str, str] = {}  # vLLM: remote_request_id -> X-Request-Id of its prefill (in-process)


class FakeWorker:
    def __init__(self, engine: str = "vllm", role: str = "plain", model: str = "fake-model",
                 chunks: int = 4, token_delay_s: float = 0.0, bootstrap_port: int | None = None,
                 serves_tokenize: bool = True):
        self.engine, self.role, self.model, self.chunks = engine, role, model, chunks
        self.token_delay_s, self.bootstrap_port = token_delay_s, bootstrap_port
        self.engine_id = uuid.uuid4().hex
        self.requests: list[dict[str, Any]] = []  # {"path", "body", "raw", "headers", "peer": (host, port)}
        self.cancelled: list[str] = []  # request ids whose client (the router) went away
        self.completed: list[str] = []
        self.hang = False  # accept and never answer
        self.fail_status: int | None = None  # answer every request with this status
        self.poison: str | None = None  # answer 500 to a prompt holding this text (an input the engine chokes on)
        self.die_after: int | None = None  # close the connection after this many stream chunks
        self.stall_after: int | None = None  # go silent (connection open) after this many stream chunks
        self.healthy = True
        self.health_delay_s = 0.0  # a busy engine answers /health late
        self.serves_tokenize = serves_tokenize  # False: no POST /tokenize (an engine version without it)
        self.port = 0
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        if self.serves_tokenize:
            app.router.add_post("/tokenize", self.tokenize)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> FakeWorker:
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=2048)  # bench bursts: no SYN drops
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def health(self, request):
        await asyncio.sleep(self.health_delay_s)
        return web.Response(text="OK") if self.healthy else web.Response(status=503, text="unhealthy")

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def tokenize(self, request):
        b = await request.json()
        text = b.get("prompt") or "".join(f"<|{m['role']}|>{m['content']}" for m in b.get("messages", []))
        return web.json_response({"tokens": [ord(c) for c in text], "count": len(text)})

    # --- generation -----------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        rid = request.headers.get("X-Request-Id", uuid.uuid4().hex)
        self.requests.append({"path": request.path, "body": body, "raw": raw,
                              "headers": {k.lower(): v for k, v in request.headers.items()},
                              "peer": request.transport.get_extra_info("peername")})
        try:
            return await self._generate(request, body, rid)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise

    async def _generate(self, request, body, rid):
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail_status:
            return web.json_response({"error": {"message": "injected failure"}}, status=self.fail_status)
        if body.get("model") not in (None, self.model):
            return web.json_response({"error": {"message": f"model {body.get('model')} not found"}}, status=404)
        if self.poison is not None and self.poison in json.dumps(body.get("prompt", body.get("messages"))):
            return web.json_response({"error": {"message": "EngineCore failed on this input"}}, status=500)
        n = body.get("max_tokens") or body.get("max_completion_tokens") or self.chunks
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:  # as vLLM's request validation says
            return web.json_response({"error": {"message": "max_tokens must be an integer >= 0"}}, status=400)
        params = body.get("kv_transfer_params")
        params = params if isinstance(params, dict) else {}
        if self.engine == "vllm" and params.get("do_remote_decode"):
            return self._vllm_prefill(body, rid, params)
        if self.engine == "vllm" and params.get("do_remote_prefill"):
            origin = ISSUED.get(params.get("remote_request_id", ""))
            if origin is not None and origin != rid:
                return web.json_response({"error": {"message": "X-Request-Id differs from prefill's"}}, status=400)
        if self.engine == "sglang" and self.role in ("prefill", "decode"):
            room = body.get("bootstrap_room")
            if room is None or "bootstrap_host" not in body:
                return web.json_response({"error": {"message": "PD request without bootstrap_room"}}, status=400)
            rooms = room if isinstance(room, list) else [room]
            if self.role == "prefill":
                for r in rooms:
                    ROOMS.setdefault(r, asyncio.Event()).set()
            else:
                try:
                    for r in rooms:
                        await asyncio.wait_for(ROOMS.setdefault(r, asyncio.Event()).wait(), 5)
                except asyncio.TimeoutError:
                    return web.json_response({"error": {"message": "KV transfer from prefill timed out"}},
                                             status=500)
        n = max(1, min(n, self.chunks))
        if body.get("stream"):
            return await self._stream(request, body, rid, n)
        await asyncio.sleep(self.token_delay_s * n)
        self.completed.append(rid)
        return web.json_response(self._full(body, rid, n))

    def _vllm_prefill(self, body, rid, params):
        if body.get("max_tokens") != 1 or body.get("stream"):
            return web.json_response({"error": {"message": "prefill must be max_tokens 1, stream false"}},
                                     status=400)
        remote_rid = f"cmpl-{rid}-0-{uuid.uuid4().hex[:8]}"
        ISSUED[remote_rid] = rid
        out = self._full(body, rid, 1)
        out["kv_transfer_params"] = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
            "remote_engine_id": self.engine_id, "remote_request_id": remote_rid, "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 3,
            "remote_blocks_expiry_time": None, "transfer_mode": "pull", "remote_prefill_cached_tokens": 0}
        self.completed.append(rid)
        return web.json_response(out)

    def _full(self, body, rid, n) -> dict:
        text = " ".join(f"tok{i}" for i in range(n))
        chat = "messages" in body
        choice = {"index": 0, "finish_reason": "length", "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {"id": f"cmpl-{rid}", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": [choice],
                "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}

    async def _stream(self, request, body, rid, n) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = "messages" in body
        for i in range(n):
            if self.die_after is not None and i >= self.die_after:
                request.transport.close()  # the worker "dies": connection cut mid-stream
                return resp
            if self.stall_after is not None and i >= self.stall_after:
                await asyncio.sleep(3600)  # the worker hangs mid-stream
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            last = i == n - 1
            choice = {"index": 0, "finish_reason": "length" if last else None, "logprobs": None}
            choice.update({"delta": {"content": f"tok{i} "}} if chat else {"text": f"tok{i} "})
            chunk = {"id": f"cmpl-{rid}", "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": self.model, "choices": [choice]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        self.completed.append(rid)
        await resp.write_eof()
        return resp


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="fake OpenAI-compatible worker (vLLM/SGLang PD semantics)")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (0: any)")
    ap.add_argument("--engine", default="vllm", choices=("vllm", "sglang"), help="PD protocol to follow")
    ap.add_argument("--role", default="plain", choices=("plain", "prefill", "decode"), help="PD role")
    ap.add_argument("--chunks", type=int, default=4, help="tokens per answer")
    ap.add_argument("--token-delay", type=float, default=0.0, help="seconds between streamed tokens")
    args = ap.parse_args(argv)

    async def run() -> None:
        w = await FakeWorker(args.engine, args.role, chunks=args.chunks, token_delay_s=args.token_delay).start(
            port=args.port)
        print(f"fake worker on {w.url}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
