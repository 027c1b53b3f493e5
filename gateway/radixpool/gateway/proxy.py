"""The gateway application: endpoints, the routed proxy loop, and ground-truth feedback.

Per routed request: parse and validate the JSON body (400 names the field, before any worker
sees it), build the route key, ask the policy for a worker, send over a pooled keep-alive
connection, and relay the answer — a non-streamed body in one write, an SSE stream event by event
as it arrives. A connect error or a 503 before the first byte is retried on another worker (at
most `max_retries` times, reason `retry`), and the policy's optimistic insert for the failed
worker is undone. The worker's own status and error body pass through unchanged otherwise.

Streams ask the worker for `stream_options.include_usage` so every answer reports
`cached_tokens`; the added usage event is stripped when the client did not ask for it. The report
feeds the metrics and the tree correction (`feedback.first_missing_block` → `trim_through`).

Deadlines: a worker that sends no headers within `upstream_first_byte_timeout`, or does not finish
within `upstream_timeout`, is cut: 504 (or, mid-stream, a last error event), counted in
`radixpool_gateway_upstream_timeouts_total`, and its breaker records a failure. So does a 200
stream the worker ends with an error event of its own (`stream_errors`); any stream that ends in
an error event is counted in the metrics under the error's status, not its 200. An error whose
code says the worker failed that one request alone (`nonfinite_logits`) is passed through and
counted in the metrics, but is neither a failure nor a success for the breaker: one client's
poison prompt must not take the workers out one by one. A client that
leaves cancels its handler (see `http_edge`): the worker connection closes on the way out, the
worker aborts the request, and the in-flight count drops. A large body is parsed and its route
key built in a child process (`body_parsing`), over at most `max_route_prompt_chars` of the
prompt, so one huge or hostile body never holds up the small ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from dataclasses import dataclass
from urllib.parse import quote

from radixpool.gateway import admin
from radixpool.gateway.access import AccessPolicy, presented_key
from radixpool.gateway.body_parsing import BodyParser, BodyTooComplex
from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.feedback import (
    answer_usage,
    is_usage_only_event,
    learn,
    prefill_wait,
    usage_in,
)
from radixpool.gateway.holding import Holding
from radixpool.gateway.http_edge import (
    REQUEST_ID,
    Headers,
    Request,
    Responder,
    error_body,
    method_not_allowed,
)
from radixpool.gateway.metrics import GatewayMetrics
from radixpool.gateway.model_list import MODEL_LIST_TIMEOUT_S, merge_model_lists, one_per_model
from radixpool.gateway.policies import CacheAware, Decision, make_policy
from radixpool.gateway.prefix_index import PrefixIndex
from radixpool.gateway.quarantine import Quarantine, engine_died
from radixpool.gateway.route_key import (
    ROUTED_PATHS,
    BadRequest,
    KeyBuilder,
    RouteKey,
)
from radixpool.gateway.stream_errors import WorkerError, answer_error, error_event
from radixpool.gateway.upstream import (
    HOP_BY_HOP,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)
from radixpool.gateway.wait_queue import LateBinding
from radixpool.gateway.workers import Worker, WorkerSet, candidates
from radixpool.protocol.errors import NO_RETRY
from radixpool.tokenization import PromptTokenizer

log = logging.getLogger("radixpool.gateway")

READ_ONLY_PATHS = ("/livez", "/health", "/metrics", "/v1/models")
FORGET_EVERY_S = 60.0   # gone workers' counters are dropped on membership changes this often
QUARANTINED = object()   # _dispatch's answer for a request a second dying engine held
DRAINED = object()   # _dispatch's answer for a request still held when the gateway's drain ended
WORKER_TIMEOUT = "worker_timeout"   # the code of a 504 (and of a stream cut) for a slow worker
MODEL_PATH = "/v1/models/"   # + a model id
DONE_EVENT = b"data: [DONE]\n\n"   # the last event of a whole OpenAI stream


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: PromptTokenizer | None = None,
                 block_size: int | None = None) -> None:
        self.config = config
        self.index = PrefixIndex()
        self.keys = KeyBuilder(config.text_block_bytes, config.prefix_token_count,
                               config.max_route_prompt_chars)
        if tokenizer is not None:
            self.keys.use_tokenizer(tokenizer, block_size)
        self.bodies = BodyParser(self.keys, config.parse_processes, config.parse_memory_bytes)
        self.workers = WorkerSet(config, self.index, self.keys)
        self.policy = make_policy(config, self.index)
        self.metrics = GatewayMetrics(config.removed_worker_series_seconds)
        self.pools: dict[str, UpstreamPool] = {}
        self.clock = time.monotonic
        self.draining = False  # shutting down: in-flight requests finish, new ones are refused
        self.access = AccessPolicy(config.api_key, config.admin_api_key)
        self.quarantine = Quarantine(ttl_s=config.quarantine_seconds) \
            if config.quarantine_seconds > 0 else None
        key = config.upstream_key
        self.upstream_auth: Headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        # client headers not forwarded: hop-by-hop ones, and the client's key when we send ours
        self._unforwarded = HOP_BY_HOP | {b"authorization", b"x-api-key"} if key else HOP_BY_HOP
        self._next_forget = 0.0
        self.workers.membership_hooks.append(self._membership)
        self.holding = Holding(
            LateBinding(self.policy, config.hold_queued_tokens, config.hold_max_requests,
                        config.hold_max_seconds),
            self.workers, self.metrics, self.clock, self._release) if config.late_binding else None
        for url in config.worker_urls:
            self.workers.add(url)

    def _membership(self, worker: Worker, joined: bool) -> None:
        self.metrics.named(worker)
        if not joined:
            self.forget_pool(worker.url)
        if self.holding:   # it may take held requests, or was the cache owner some waited for
            self.holding.offer()
        now = self.clock()
        if now >= self._next_forget:   # at most once a minute: a rollout changes many at once
            self._next_forget = now + FORGET_EVERY_S
            self.metrics.forget_gone(self.workers, now)

    @property
    def predicts(self) -> bool:
        return isinstance(self.policy, CacheAware)

    def pool(self, worker: Worker) -> UpstreamPool:
        pool = self.pools.get(worker.url)
        if pool is None:
            pool = self.pools[worker.url] = UpstreamPool(
                worker.host, worker.port, self.config.connect_timeout)
        return pool

    def forget_pool(self, url: str) -> None:
        """Idle connections of a removed worker close; in-flight ones finish on their own."""
        pool = self.pools.pop(url, None)
        if pool is not None:
            pool.close()

    def hung(self, worker: Worker) -> None:
        """The health checks found `worker` hung: the requests still waiting there for their
        response headers fail now (`WorkerHung`) and are retried on other workers, instead of
        waiting out `upstream_first_byte_timeout`; the streams it has sent nothing on for as long
        as its last check waited are cut (an error event), instead of waiting out
        `upstream_timeout`."""
        pool = self.pools.get(worker.url)
        if pool is not None and pool.give_up_waiting(f"worker {worker.url} stopped answering "
                                                     "its health checks",
                                                     self.config.health_timeout):
            log.warning("worker %s is hung: retrying elsewhere the requests it has not "
                        "answered yet, cutting the streams it went silent on", worker.url)

    async def fetch(self, worker: Worker, path: str) -> tuple[int, bytes]:
        """`GET path` from a worker with the gateway's worker key: the health monitor's way out."""
        upstream = await self.pool(worker).request("GET", path, self.upstream_auth)
        return upstream.status, await upstream.body()

    # --- endpoints ----------------------------------------------------------------------------
    def screen(self, method: str, path: str, headers: dict[bytes, bytes]
               ) -> tuple[int, Headers, bytes] | None:
        """The edge's check of a request's head, before its body is read: the keys
        (`AccessPolicy`). None lets the request through to `__call__`."""
        denied = self.access.check(path, method, presented_key(
            headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")))
        if denied is None:
            return None
        status, error_headers, doc = error_body(*denied)
        if status == 401:
            error_headers = [(b"www-authenticate", b"Bearer"), *error_headers]
        return status, error_headers, doc

    async def __call__(self, request: Request, respond: Responder) -> None:
        """A request that passed `screen`."""
        path, method = request.path, request.method
        if self.draining:  # a kept-alive client would find the connection gone mid-request later
            respond.closing = True
        if path in ROUTED_PATHS:
            if method != "POST":
                await respond.send(*method_not_allowed(f"{path} accepts POST, not {method}",
                                                       "POST"))
            else:
                await self.proxy(request, respond)
        elif (path in READ_ONLY_PATHS or path.startswith(MODEL_PATH)) \
                and method not in ("GET", "HEAD"):
            await respond.send(*method_not_allowed(f"{path} accepts GET, not {method}",
                                                   "GET, HEAD"))
        elif path == "/livez":  # the process serves; workers do not matter here
            await respond.send(200, [(b"content-type", b"application/json")], b'{"status":"ok"}')
        elif path == "/health":
            # ready once a worker has passed a check: one merely listed may not be there
            ready = sum(w.health.proven for w in self.workers.eligible(self.clock()))
            await respond.send(*admin.health_body(ready, len(self.workers), self.draining))
        elif path == "/metrics":
            body = self.metrics.render(self.workers, self.index, self.clock())
            await respond.send(200, [(b"content-type", b"text/plain; version=0.0.4")], body)
        elif path == "/v1/models" or path.startswith(MODEL_PATH):
            await self.forward_models(request, respond)
        elif path == "/workers":
            await respond.send(*admin.workers_endpoint(self.workers, self.metrics.fleet, request,
                                                       self.clock()))
        else:
            await respond.send_error(404, f"unknown path {path!r}; the gateway serves "
                                          f"{', '.join(ROUTED_PATHS)}, /v1/models[/ID], /workers, "
                                          "/health, /livez, /metrics", "not_found")

    async def forward_models(self, request: Request, respond: Responder) -> None:
        """`/v1/models/{id}` from a worker serving `id` if any does (the others answer 404
        naming it); `/v1/models` from one worker per model served, their lists merged."""
        model = request.path[len(MODEL_PATH):] or None
        if model is not None and ".." in re.split(r"[/\\]", model):
            # No model is named so, and the request carries the gateway's worker key: a proxy
            # before the worker that resolves dot segments (a mesh sidecar) would take
            # /v1/models/../../kv_events to that control path.
            await respond.send_error(404, f"the model {model!r} does not exist",
                                     "model_not_found", "model")
            return
        ready = self.workers.eligible(self.clock(), model)
        if not ready:
            _, headers, doc = error_body(503, "no healthy worker available" + (
                f" for model {model!r}" if model else ""))
            await respond.send(503, [(b"retry-after", b"1"), *headers], doc)
            return
        asked = one_per_model(ready) if model is None else [min(ready, key=lambda w: w.inflight)]
        answers = await asyncio.gather(*(self._get_models(w, request) for w in asked))
        if len(answers) > 1:
            merged = merge_model_lists([body for status, _, body in answers if status == 200])
            if merged is not None:
                await respond.send(200, [(b"content-type", b"application/json")], merged)
                return
        await respond.send(*answers[0])

    async def _get_models(self, worker: Worker, request: Request) -> tuple[int, Headers, bytes]:
        """A worker's answer to the client's models request, or the gateway's error for it."""
        sent = self.clock()
        deadline = min(self.config.upstream_first_byte_timeout, MODEL_LIST_TIMEOUT_S)
        try:
            upstream = await self.pool(worker).request(
                "GET", quote(request.path), self.forwarded_headers(request),
                first_byte_timeout=deadline, total_timeout=deadline)
            body = await upstream.body()
        except UpstreamTimeout as exc:
            self._timed_out(worker, sent)
            return error_body(504, f"worker {worker.url} timed out: {exc}", WORKER_TIMEOUT)
        except UpstreamError as exc:
            return error_body(502, f"worker {worker.url} failed: {exc}")
        return upstream.status, _response_headers(upstream, worker), body

    # --- the routed proxy ---------------------------------------------------------------------
    async def proxy(self, request: Request, respond: Responder) -> None:
        started = time.perf_counter()
        if self.draining:
            await self._refuse_draining(respond, started)
            return
        try:
            parsed = await self.bodies.parse(request.path, request.body)
        except BadRequest as exc:
            await self._refuse(respond, started, 400, str(exc), exc.code, exc.param)
            return
        except BodyTooComplex as exc:
            await self._refuse(respond, started, 413, str(exc), "request_too_large")
            return
        key = parsed.key
        if key.model is not None and not self.workers.serves(key.model):
            # routed as if it named none (any worker; one answers 404): the policy keeps demand
            # by model, and names nobody serves must not each get some
            key.model = None
        if self.quarantine is not None and self.quarantine.refuses(parsed.body, self.clock()):
            await self._quarantined(respond, started)
            return
        headers = self.forwarded_headers(request)
        picked = await self._dispatch(request.path, headers, parsed.body, key, started)
        if picked is QUARANTINED:
            await self._quarantined(respond, started)
            return
        if picked is DRAINED:
            await self._refuse_draining(respond, started)
            return
        if len(picked) == 2:
            status, message = picked
            await self._refuse(respond, started, status, message,
                               WORKER_TIMEOUT if status == 504 else None,
                               headers=[(b"retry-after", b"1")])
            return
        worker, decision, upstream = picked
        try:
            await self._relay(worker, decision, key, upstream, respond, parsed.strip_usage,
                              started, parsed.body)
        finally:
            self._release(worker, prefill_wait(decision, key), key.sequences)

    async def _refuse_draining(self, respond: Responder, started: float) -> None:
        respond.closing = True   # held since before the drain: its connection closes too
        await self._refuse(respond, started, 503, "the gateway is shutting down; retry",
                           "draining", headers=[(b"retry-after", b"1")])

    async def _quarantined(self, respond: Responder, started: float) -> None:
        self.metrics.quarantined += 1
        await self._refuse(
            respond, started, 500, f"this request was in the engines of "
            f"{self.quarantine.deaths_to_refuse} workers when each of them died; it is refused "
            f"for {self.quarantine.ttl_s:g} s so that it cannot take down more",
            "request_quarantined", headers=[(NO_RETRY[0].encode(), NO_RETRY[1].encode())])

    async def _refuse(self, respond: Responder, started: float, status: int, message: str,
                      code: str | None = None, param: str | None = None,
                      headers: Headers = ()) -> None:
        """An answer the gateway gives a routed request itself, counted with worker="gateway"."""
        _, error_headers, doc = error_body(status, message, code, param)
        await respond.send(status, [*headers, *error_headers], doc)
        self.metrics.answered("gateway", status, time.perf_counter() - started, None)

    async def _dispatch(self, path: str, headers: Headers, body: bytes, key: RouteKey,
                        started: float
                        ) -> tuple[Worker, Decision, UpstreamResponse] | tuple[int, str] | object:
        """Pick a worker and get its response headers, retrying connect errors and 503s on
        others. Returns the worker (its in-flight count taken), or the status and reason to
        answer with: 502 when a worker failed, 503 when none was available or all were busy;
        QUARANTINED when the request was in a second engine that died; or DRAINED when it was
        still held when the gateway's drain ended. A client that leaves meanwhile is counted as
        a 499 here (a non-streamed request leaves before any header). A failed worker's breaker
        (and draining flag) are set before `_release` offers the held requests: none goes
        there, and they are offered again when its cool-down ends."""
        tried: set[str] = set()
        errors: list[str] = []
        busy = 0
        for attempt in range(self.config.max_retries + 1):
            now = self.clock()
            ready = [w for w in self.workers.eligible(now, key.model) if w.url not in tried]
            if not ready:
                break
            by_url = {w.url: w for w in ready}
            decision = self.policy.select(candidates(ready, key), key)
            worker = by_url[decision.worker]
            wait = prefill_wait(decision, key)
            if (not attempt and self.holding is not None
                    and self.holding.holds(worker, decision, key)):
                self.policy.failed(decision, key)
                try:
                    held = await self.holding.wait(key)
                except asyncio.CancelledError:
                    self._left("gateway", started)
                    raise
                if held is None:
                    if self.holding.closed:
                        return DRAINED
                    break
                worker, decision = held.worker, held.decision
                wait = prefill_wait(decision, key)
            else:   # (a held request's worker was taken, its breaker told, when it was placed)
                worker.take(wait, key.sequences)
                worker.breaker.dispatched(now)
            self.metrics.decision(worker.url, "retry" if attempt else decision.reason)
            if attempt:
                self.metrics.retry()
            try:
                upstream = await self.pool(worker).request(
                    "POST", path, headers, body, self.config.upstream_first_byte_timeout,
                    self.config.upstream_timeout)
            except UpstreamTimeout as exc:  # a hung worker: no retry (it may still be working)
                self._timed_out(worker, now)
                self._release(worker, wait, key.sequences)
                self.policy.failed(decision, key)
                return 504, f"worker {worker.url} timed out: {exc}"
            except UpstreamError as exc:
                worker.breaker.record_failure("connect_error", self.clock())
                self._release(worker, wait, key.sequences)
                errors.append(f"{worker.url}: {exc}")
            except BaseException as exc:
                self._release(worker, wait, key.sequences)
                if isinstance(exc, asyncio.CancelledError):  # the client left meanwhile
                    self._left(worker.url, started)
                raise
            else:
                if upstream.status != 503 or attempt == self.config.max_retries:
                    return worker, decision, upstream
                worker.breaker.record_failure("server_error", self.clock())
                worker.draining = True  # cleared when its /health answers 200 again
                self._release(worker, wait, key.sequences)
                answer = b""
                with contextlib.suppress(UpstreamError):
                    answer = await upstream.body()  # to the end: the connection is reused
                if self._engine_died(answer, body):
                    self.policy.failed(decision, key)
                    return QUARANTINED
                errors.append(f"{worker.url}: 503 (draining or overloaded)")
                busy += 1
            self.policy.failed(decision, key)
            tried.add(worker.url)
        if errors:
            return 503 if busy == len(errors) else 502, \
                f"all {len(errors)} attempts failed: " + "; ".join(errors)
        return 503, "no healthy worker available" + (
            f" for model {key.model!r}" if key.model else "")

    async def _relay(self, worker: Worker, decision: Decision, key: RouteKey,
                     upstream: UpstreamResponse, respond: Responder, strip_usage: bool,
                     started: float, body: bytes) -> None:
        status = upstream.status
        headers = _response_headers(upstream, worker)
        seen = StreamSeen()
        try:
            if b"text/event-stream" not in (upstream.header(b"content-type") or b""):
                data = await upstream.body()
                if status == 503 and self._engine_died(data, body):   # its last attempt
                    worker.breaker.record_failure("server_error", self.clock())
                    self.policy.failed(decision, key)
                    await self._quarantined(respond, started)
                    return
                await respond.send(status, headers, data)
                usage = answer_usage(data) if status == 200 else None
                if status >= 500:
                    seen.error = answer_error(status, data)
            else:
                await respond.start(status, headers)
                usage = await self._relay_events(upstream, respond, strip_usage, started, seen)
        except UpstreamError as exc:
            timed_out = isinstance(exc, UpstreamTimeout)
            if timed_out:
                self._timed_out(worker, self.clock() - (time.perf_counter() - started))
            else:
                worker.breaker.record_failure("cut", self.clock())
            upstream.release()
            code = 504 if timed_out else 502
            if not respond.started:
                await respond.send_error(code, f"worker {worker.url} failed before answering: "
                                               f"{exc}", _cut_code(exc))
            else:
                # A cut stream: one last event says why (the openai SDK raises it as an APIError
                # instead of a bare "Connection error"), and no [DONE] follows.
                await respond.write(_cut_stream_event(worker.url, exc))
            self.metrics.answered(worker.url, code, time.perf_counter() - started,
                                  seen.first_event_s)
            return
        except asyncio.CancelledError:  # the client left: the worker connection closes below
            self._left(worker.url, started, seen.first_event_s)
            raise
        finally:
            upstream.release()
        if respond.disconnected:  # noticed by a failed write rather than by cancellation
            self._left(worker.url, started, seen.first_event_s)
            return
        if seen.error is not None and seen.error.request_specific:
            worker.breaker.record_request_error(self.clock())
            worker.answered_at = self.clock()   # it answers: not hung
        elif status >= 500:
            worker.breaker.record_failure("server_error", self.clock())
        elif seen.error is not None and seen.error.status >= 500:   # a 200 it failed itself
            worker.breaker.record_failure("stream_error", self.clock())
        else:
            worker.breaker.record_success(self.clock())
            worker.answered_at = self.clock()
        if status >= 400:   # refused (a wrong model, a prompt too long, ...): nothing was cached
            self.policy.failed(decision, key)
        worker.requests += 1
        self.metrics.answered(worker.url, seen.error.status if seen.error else status,
                              time.perf_counter() - started, seen.first_event_s)
        if usage is not None:
            prompt, cached, other_prompts, other_cached = usage
            learn(worker, self.index, self.metrics, decision, key, prompt, cached, self.predicts,
                  (other_prompts, other_cached))
        elif status == 200 and seen.error is None:   # a whole answer that reports no usage
            worker.answered_unreported()

    async def _relay_events(self, upstream: UpstreamResponse, respond: Responder,
                            strip_usage: bool, started: float, seen: StreamSeen
                            ) -> tuple[int, int | None, int, int] | None:
        """Forward whole SSE events the moment they arrive; note the last usage report (as
        `answer_usage` gives it: a stream is one answer), and in `seen` when the first event
        went and the error event that ended the stream, if one did."""
        usage, pending = None, b""
        while (chunk := await upstream.read()) is not None:
            if respond.disconnected:
                break
            data = pending + chunk if pending else chunk
            cut = data.rfind(b"\n\n") + 2
            if cut < 2:
                pending = data
                continue
            ready, pending = data[:cut], data[cut:]
            if b'"prompt_tokens"' in ready:
                usage = usage_in(ready) or usage
                if strip_usage:
                    ready = b"".join(e + b"\n\n" for e in ready.split(b"\n\n")[:-1]
                                     if not is_usage_only_event(e))
            seen.error = seen.error or error_event(ready)
            if seen.first_event_s is None:
                seen.first_event_s = time.perf_counter() - started
            await respond.write(ready)
            if ready.endswith(DONE_EVENT):
                # The answer is whole: end it now. A client hangs up on [DONE] (the openai SDKs
                # do), which is no client leaving mid-answer; the worker's end of the body is
                # read only to reuse its connection.
                await respond.end()
                with contextlib.suppress(UpstreamError):
                    await upstream.body()
                break
        if pending and not respond.disconnected:
            seen.error = seen.error or error_event(pending)
            await respond.write(pending)
        return None if usage is None else (*usage, 0, 0)

    def _left(self, worker_url: str, started: float, ttfb: float | None = None) -> None:
        """Count a request whose client went away before its answer was whole."""
        self.metrics.answered(worker_url, 499, time.perf_counter() - started, ttfb)

    def _release(self, worker: Worker, wait: tuple[int, float] | None, sequences: int) -> None:
        """A dispatched request is over at `worker` (answered, failed or given up)."""
        worker.give_back(wait, sequences)
        if worker.removed and not worker.inflight:
            # its last request ended: a held request placed there just before it left made it
            # a pool anew after removal closed its own
            self.forget_pool(worker.url)
        if self.holding:
            self.holding.offer()

    def forwarded_headers(self, request: Request) -> Headers:
        """The client's end-to-end headers (the request id among them: the edge gives every
        request one), with the gateway's worker key (when it has one) in place of the
        client's. The fields its `Connection` names are for this hop alone (RFC 9110 7.6.1)."""
        unforwarded = self._unforwarded
        if (connection := request.headers.get(b"connection")) is not None:
            named = {name.strip().lower() for name in connection.split(b",")}
            unforwarded = unforwarded | (named - {REQUEST_ID})   # the edge's id goes on
        headers = [(k, v) for k, v in request.headers.items() if k not in unforwarded]
        headers.extend(self.upstream_auth)
        return headers

    def _engine_died(self, answer: bytes, body: bytes) -> bool:
        """Note a worker's 503 that says its engine died holding this request; True when the
        request is now quarantined."""
        return (self.quarantine is not None and engine_died(answer)
                and self.quarantine.died_holding(body, self.clock()))

    def _timed_out(self, worker: Worker, sent_at: float) -> None:
        """A request sent at `sent_at` ran out of time. The breaker learns of it only if the
        worker has answered nothing since: one that serves others is slow for this request (a
        long generation), not hung, and a client's own long requests must not take it out."""
        self.metrics.upstream_timeout(worker.url)
        if worker.answered_at <= sent_at:
            worker.breaker.record_failure("timeout", self.clock())


@dataclass
class StreamSeen:
    """What the relay of one answer saw, noted as it goes (a client that leaves mid-way still
    has it). Only a stream has a time to first token: a whole answer's first byte is its last,
    so it counts in the request duration alone."""

    first_event_s: float | None = None   # seconds from the request's start to its first event
    error: WorkerError | None = None   # the worker's error: its 5xx body, or a stream's event


def _cut_code(exc: UpstreamError) -> str:
    return WORKER_TIMEOUT if isinstance(exc, UpstreamTimeout) else "worker_failed"


def _cut_stream_event(worker_url: str, exc: UpstreamError) -> bytes:
    timed_out = isinstance(exc, UpstreamTimeout)
    error = {"message": f"worker {worker_url} {'timed out' if timed_out else 'failed'} "
                        f"mid-stream ({exc}); the answer is incomplete",
             "type": "server_error", "code": _cut_code(exc)}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


def _response_headers(upstream: UpstreamResponse, worker: Worker) -> Headers:
    headers = [(k, v) for k, v in upstream.headers if k not in HOP_BY_HOP]
    headers.append((b"x-radixpool-worker", worker.url.encode()))
    return headers
