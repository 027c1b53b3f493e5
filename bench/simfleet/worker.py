"""Simulated RadixPool workers: the worker protocol (docs/protocol.md) over the engine's own
radix cache (`SimKV`: the same `RadixCache` class and eviction policies, no model, no torch).

Each `SimWorker` serves `/v1/chat/completions`, `/v1/completions`, `/generate` (streamed or not,
`usage.prompt_tokens_details.cached_tokens` / `meta_info.cached_tokens`), `/v1/models`,
`/health`, `/server_info` (with an `instance_id` that changes on start and `/flush_cache`),
`/tokenizer`, `/load`, `/prefix_probe`, `/kv_events` (long poll, any number of readers, 409 when
the log lost the cursor or never reached it) and `/kv_events/snapshot`. Service time models a
GPU: prefills run one at a time and cost `prefill_us_per_token` per *uncached* prompt token, so
routing quality shows as latency; decode costs `decode_ms_per_token` per output token and
overlaps freely. With both at zero a request is answered at once (the gateway-overhead
benchmark). `/sim/fail` makes a worker answer
503 to requests and/or health (retry and drain tests; `health` may be the 503's body), or end
every stream after its first token with the error event a worker sends when generation fails
mid-stream (`stream_error`: the event's `error` fields, e.g. `{"type": "server_error"}`), or
answer every request 500 with an error body (`error`: its `error` fields, e.g. `{"code":
"nonfinite_logits"}`); `SimFleet` runs N workers in one loop, counts samples where one worker
sat idle while another had prefills queued, and serves its fleet-wide numbers at `GET
/sim/stats` on every worker (`DELETE /sim/stats` reads and resets).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs

from radixpool.protocol.kv_blocks import to_hex
from radixpool.protocol.server_info import ServerInfo
from radixpool.tokenization import ChatTemplateError, PromptTokenizer

from .http_server import (
    HttpProtocol,
    Request,
    Responder,
    bound_port,
    error_body,
    json_body,
)
from .kv import SimKV
from .sglang_eviction import reported

SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


@dataclass(frozen=True)
class SimConfig:
    model: str = "sim-model"
    kv_capacity_tokens: int = 65536
    block_size: int = 16
    eviction_policy: str = "lru"
    prefill_us_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    default_max_tokens: int = 4
    kv_events: bool = True
    api_key: str | None = None  # as on the worker: every path but /health and /metrics


class SimWorker:
    def __init__(self, config: SimConfig, tokenizer: PromptTokenizer, files: dict[str, str]):
        self.config = config
        self.tokenizer = tokenizer
        self.files = files
        self.cache = SimKV(config.kv_capacity_tokens, config.block_size, config.eviction_policy)
        self.instance_id = uuid.uuid4().hex
        self.prefill_lock = asyncio.Lock()
        self.running = 0
        self.waiting = 0
        self.live = 0   # requests being served (prefill, decode or streaming): the reported load
        self.fail_requests = False
        self.fail_health: bool | dict = False   # a dict: the body of its 503
        self.stream_error: dict | None = None   # streams end after a token with this error
        self.error: dict | None = None   # every request is answered 500 with this error
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.requests = 0
        self.server: asyncio.Server | None = None
        self.connections: set[HttpProtocol] = set()
        self.fleet_stats: Callable[[bool], dict] | None = None  # set by SimFleet

    @property
    def port(self) -> int:
        assert self.server is not None
        return bound_port(self.server)

    @property
    def url(self) -> str:
        """Its address as bound (127.0.0.1 by default); a wildcard bind answers on loopback."""
        assert self.server is not None
        host = self.server.sockets[0].getsockname()[0]
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def info(self) -> ServerInfo:
        c = self.config
        return ServerInfo(c.model, c.model, 1 << 20, c.kv_capacity_tokens, 1, c.block_size,
                          self.instance_id, "sim", c.kv_events, reported(c.eviction_policy))

    def flush(self) -> None:
        self.cache.clear()
        self.instance_id = uuid.uuid4().hex

    # --- routing ------------------------------------------------------------------------------
    async def __call__(self, request: Request, respond: Responder) -> None:
        path = request.path
        key = self.config.api_key
        if key and path not in ("/health", "/metrics") and \
                request.headers.get(b"authorization") != f"Bearer {key}".encode():
            await respond.send(*error_body(401, "missing or wrong API key", "invalid_api_key"))
        elif path in ("/v1/chat/completions", "/v1/completions", "/generate"):
            await self.generate(request, respond)
        elif path == "/health":
            bad = self.fail_health
            await respond.send(*json_body(503 if bad else 200, bad if isinstance(bad, dict)
                                          else {"status": "draining" if bad else "ok"}))
        elif path == "/server_info":
            await respond.send(*json_body(200, self.info().to_json()))
        elif path == "/tokenizer":
            await respond.send(*json_body(200, {"files": self.files}))
        elif path == "/load":
            await respond.send(*json_body(200, {"running": self.running, "waiting": self.waiting,
                                                "kv_usage": self.kv_usage(),
                                                "instance_id": self.instance_id}))
        elif path == "/v1/models":
            await respond.send(*json_body(200, {"object": "list", "data": [
                {"id": self.config.model, "object": "model", "owned_by": "radixpool"}]}))
        elif path == "/flush_cache":
            self.flush()
            await respond.send(*json_body(200, {"instance_id": self.instance_id}))
        elif path == "/prefix_probe":
            await self.prefix_probe(request, respond)
        elif path == "/kv_events/snapshot":
            await respond.send(*json_body(200, {"instance_id": self.instance_id,
                                                "seq": self.cache.seq,
                                                "blocks": to_hex(self.cache.blocks)}))
        elif path == "/kv_events":
            await self.kv_events(request, respond)
        elif path == "/sim/stats" and self.fleet_stats is not None:
            await respond.send(*json_body(200, self.fleet_stats(request.method == "DELETE")))
        elif path == "/sim/fail":
            doc = json.loads(request.body or b"{}")
            self.fail_requests = bool(doc.get("requests"))
            health = doc.get("health")   # a dict: the 503's body
            self.fail_health = health if isinstance(health, dict) else bool(health)
            self.stream_error = doc.get("stream_error")
            self.error = doc.get("error")
            await respond.send(*json_body(200, doc))
        else:
            await respond.send(*error_body(404, f"unknown path {path}"))

    def kv_usage(self) -> float:
        return self.cache.usage()

    async def kv_events(self, request: Request, respond: Responder) -> None:
        """As the worker serves it: every reader keeps its own cursor (`since`) into one log, so
        any number of gateways can long-poll the same worker and each sees every event."""
        query = parse_qs(request.query)
        since = int(query.get("since", ["0"])[0])
        timeout = float(query.get("timeout", ["10"])[0])
        seen = query.get("load")
        queued = query.get("queued", ["0"])[0] in ("1", "true")
        log = self.cache.events
        events = None if since > log.last_seq else log.events_since(since)
        if events == [] and timeout > 0:
            await log.wait(since, timeout, lambda: self.live, int(seen[0]) if seen else None)
            events = log.events_since(since)
        if events is None:
            await respond.send(*json_body(409, {"error": {
                "code": "resync_required", "message": f"events after {since} are no longer "
                                                      f"available (latest is {log.last_seq})"}}))
            return
        shown = events if queued else [e for e in events if e.type != "queued"]
        await respond.send(*json_body(200, {
            "instance_id": self.instance_id, "events": [e.to_json() for e in shown],
            "next": events[-1].seq if events else since,
            "load": {"requests": self.live}}))

    # --- requests -----------------------------------------------------------------------------
    def prompt_ids(self, path: str, doc: dict) -> list[int]:
        if path == "/v1/chat/completions":
            return self.tokenizer.encode_chat(doc["messages"])
        field = "prompt" if path == "/v1/completions" else "text"
        if path == "/generate" and doc.get("input_ids") is not None:
            ids = doc["input_ids"]
            return ids[0] if ids and isinstance(ids[0], list) else ids
        value = doc[field]
        return self.tokenizer.encode(value[0] if isinstance(value, list) else value)

    async def prefix_probe(self, request: Request, respond: Responder) -> None:
        doc = json.loads(request.body)
        if "input_ids" in doc:
            ids = doc["input_ids"]
        elif "messages" in doc:
            ids = self.tokenizer.encode_chat(doc["messages"])
        else:
            ids = self.tokenizer.encode(doc.get("text", ""))
        cached = self.cache.probe(ids, doc.get("cache_salt"))
        await respond.send(*json_body(200, {"prompt_tokens": len(ids), "cached_tokens": cached}))

    async def generate(self, request: Request, respond: Responder) -> None:
        if self.fail_requests:
            await respond.send(503, [(b"retry-after", b"1"), (b"content-type",
                                                              b"application/json")],
                               b'{"error": {"message": "draining", "code": "unavailable"}}')
            return
        if self.error is not None:   # as a worker answers a request its engine failed
            error = {"message": "generation failed", "type": "server_error", "param": None,
                     "code": None}
            await respond.send(*json_body(500, {"error": {**error, **self.error}}))
            return
        try:
            doc = json.loads(request.body)
            ids = self.prompt_ids(request.path, doc)
        except (ValueError, KeyError, TypeError, IndexError, ChatTemplateError) as exc:
            await respond.send(*error_body(400, f"bad request: {exc!r}"))
            return
        max_tokens = doc.get("max_tokens", (doc.get("sampling_params") or {}).get(
            "max_new_tokens", self.config.default_max_tokens))
        if not isinstance(max_tokens, int) or max_tokens < 0:
            await respond.send(*error_body(400, "max_tokens must be a non-negative integer",
                                           "invalid_max_tokens"))
            return
        self._count_live(+1)
        self.cache.announce(ids, doc.get("cache_salt"))
        try:
            cached = await self._prefill(ids, doc.get("cache_salt"))
            self.requests += 1
            self.prompt_tokens += len(ids)
            self.cached_tokens += cached
            usage = {"prompt_tokens": len(ids), "completion_tokens": max_tokens,
                     "total_tokens": len(ids) + max_tokens,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            words = [f"w{i % 97}" for i in range(max_tokens)]
            if doc.get("stream"):
                await self._stream(request.path, doc, words, usage, respond)
            else:
                await self._decode_wait(max_tokens)
                await respond.send(*json_body(200, _final(request.path, self.config.model,
                                                          words, usage)))
        finally:
            self._count_live(-1)

    def _count_live(self, change: int) -> None:
        """A request starts or ends here: the load the KV stream reports changes."""
        self.live += change
        self.cache.events.touch()

    async def _prefill(self, ids: list[int], namespace: str | None) -> int:
        cost = self.config.prefill_us_per_token
        if cost <= 0:
            return self.cache.prefill(ids, namespace)
        self.waiting += 1
        async with self.prefill_lock:
            self.waiting -= 1
            self.running += 1
            cached, match = self.cache.start(ids, namespace)
            try:
                await asyncio.sleep((len(ids) - cached) * cost / 1e6)
            finally:
                self.cache.finish(ids, namespace, match)
                self.running -= 1
        return cached

    async def _decode_wait(self, tokens: int) -> None:
        if self.config.decode_ms_per_token > 0 and tokens:
            await asyncio.sleep(tokens * self.config.decode_ms_per_token / 1000)

    async def _stream(self, path: str, doc: dict, words: list[str], usage: dict,
                      respond: Responder) -> None:
        model = self.config.model
        include_usage = bool((doc.get("stream_options") or {}).get("include_usage"))
        failure = self.stream_error
        await respond.start(200, SSE)
        for i, word in enumerate(words[:1] if failure is not None else words):
            await self._decode_wait(1)
            last = i == len(words) - 1
            await respond.write(_sse(_chunk(path, model, word + " ", "length" if last else None,
                                            usage, include_usage)))
        if failure is not None:   # as a worker ends a stream whose generation failed
            error = {"message": "generation failed", "type": "server_error", "param": None,
                     "code": None}
            await respond.write(_sse({"error": {**error, **failure}}))
        elif include_usage and path != "/generate":
            event = {"id": "sim", "object": _OBJECT[path] + ".chunk", "model": model,
                     "choices": [], "usage": usage}
            await respond.write(_sse(event))
        await respond.write(b"data: [DONE]\n\n")
        await respond.end()


_OBJECT = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion"}


def _sse(doc: dict) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def _chunk(path: str, model: str, text: str, finish: str | None, usage: dict,
           include_usage: bool) -> dict:
    if path == "/generate":
        return {"text": text, "meta_info": {**_meta(usage), "finish_reason": finish}}
    choice: dict = {"index": 0, "finish_reason": finish}
    if path == "/v1/chat/completions":
        choice["delta"] = {"role": "assistant", "content": text}
        kind = "chat.completion.chunk"
    else:
        choice["text"] = text
        kind = "text_completion"
    doc = {"id": "sim", "object": kind, "model": model, "choices": [choice]}
    if include_usage:
        doc["usage"] = None
    return doc


def _meta(usage: dict) -> dict:
    return {"prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def _final(path: str, model: str, words: list[str], usage: dict) -> dict:
    text = " ".join(words)
    if path == "/generate":
        return {"text": text, "meta_info": {**_meta(usage), "finish_reason": "length"}}
    if path == "/v1/chat/completions":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": "length"}
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length"}
    return {"id": "sim", "object": _OBJECT[path], "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage}
