"""Worker lifecycle (loading → ready → draining → stopped, or failed) and the ASGI gate in front
of the app.

The gate is plain ASGI (no per-request Starlette middleware objects) and does three things:
- Keys (`Authorization: Bearer KEY` or `X-API-Key: KEY`, compared in constant time; `/health`,
  `/livez` and `/metrics` are open). The control key (`$RADIXPOOL_CONTROL_API_KEY`) is required
  for the control paths (`/flush_cache`, `/kv_events`, `/kv_events/snapshot`, `/prefix_probe`:
  the gateway's) and accepted everywhere; the serving key (`$RADIXPOOL_API_KEY`) grants every other
  path, so clients holding it cannot flush or watch the cache. Without a control key, the
  control paths take the serving key as before. A missing or wrong key gets 401, the serving key
  on a control path 403.
- While loading, draining or failed (the engine did not start, or its core process died), every
  path except the open ones gets 503 with `Retry-After` (`/health` and `/livez` answer from their
  routes).
- It counts generation requests in flight, so a drain knows when the last one has finished.
- Every answer carries `x-request-id`: the client's (the gateway sends its own) when it gave a
  usable one, else a new one, as OpenAI's API does (the SDK's `request_id` reads it).
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import json
import os
import re
from collections.abc import Awaitable

from radixpool.worker.server.errors import error_body

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})
OPEN_PATHS = frozenset({"/health", "/livez", "/metrics"})
CONTROL_PATHS = frozenset({"/flush_cache", "/kv_events", "/kv_events/snapshot", "/prefix_probe"})
RETRY_AFTER_S = 5
_USABLE_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,256}")   # printable ASCII, no spaces


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class Lifecycle:
    """Where the worker is in its life, and how many generation requests are in flight."""

    def __init__(self) -> None:
        self.phase = Phase.LOADING
        self.failure: str | None = None
        self.inflight = 0
        self.drain_expired = False   # the drain timeout passed: what still ran was aborted
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = asyncio.Event()

    @property
    def serving(self) -> bool:
        return self.phase is Phase.READY

    def mark_ready(self) -> None:
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY

    def mark_failed(self, reason: str) -> None:
        """The engine is gone for good (`reason` is what a client is told); the worker exits."""
        self.phase, self.failure = Phase.FAILED, reason
        self.stop_waiting()

    def stop_waiting(self) -> None:
        """The worker is stopping: end every wait in `until_stopping` (call on the event loop)."""
        self._stopping.set()

    async def until_stopping(self, wait: Awaitable[None]) -> None:
        """Await `wait`, or stop awaiting it once the worker begins to stop, so that a long poll
        answers at once instead of being cancelled (with a traceback) by the server's shutdown."""
        waiter = asyncio.ensure_future(wait)
        stopper = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (waiter, stopper):
                task.cancel()
            await asyncio.gather(waiter, stopper, return_exceptions=True)

    def begin_drain(self) -> bool:
        """Stop taking requests; False if already draining."""
        if self.phase is Phase.DRAINING:
            return False
        self.phase = Phase.DRAINING
        return True

    def request_started(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def request_finished(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no generation request is in flight; False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def unavailable_reason(self) -> str:
        if self.phase is Phase.LOADING:
            return "the model is still loading; retry shortly"
        if self.phase is Phase.DRAINING:
            return "this worker is shutting down; send the request to another worker"
        return f"{self.failure}; this worker is exiting"


def request_id(scope: dict) -> bytes:
    """The client's `x-request-id` if it is short printable ASCII, else a new random one."""
    for key, value in scope.get("headers", ()):
        if key == b"x-request-id":
            if _USABLE_REQUEST_ID.fullmatch(value):
                return value
            break
    return b"req_" + os.urandom(12).hex().encode()


def _with_request_id(send, rid: bytes):
    async def send_with_id(message: dict) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid)]
        await send(message)
    return send_with_id


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def _send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]]) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()), *headers]})
    await send({"type": "http.response.body", "body": payload})


class Gate:
    def __init__(self, app, lifecycle: Lifecycle, api_key: str | None,
                 control_key: str | None = None, max_body_bytes: int | None = None) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key.encode() if api_key else None
        self.control_key = control_key.encode() if control_key else None

    def _denied(self, scope: dict) -> tuple[int, str, str] | None:
        """None when the request may pass, else (status, message, code)."""
        if self.api_key is None and self.control_key is None:
            return None
        auth = _header(scope, b"authorization") or ""
        key = (auth[7:] if auth[:7].lower() == "bearer " else _header(scope, b"x-api-key")) or ""
        given = key.strip().encode()   # as the gateway reads either header
        control = self.control_key is not None and hmac.compare_digest(given, self.control_key)
        serving = self.api_key is not None and hmac.compare_digest(given, self.api_key)
        if control:
            return None
        if scope["path"] in CONTROL_PATHS and self.control_key is not None:
            if serving:
                return 403, "this path needs the control key, not the serving key", \
                    "control_key_required"
        elif serving or self.api_key is None:
            return None
        return 401, "missing or wrong API key: send `Authorization: Bearer <key>`", \
            "invalid_api_key"

    def _declared_too_large(self, scope: dict) -> bool:
        declared = _header(scope, b"content-length")
        return (self.max_body_bytes is not None and declared is not None
                and declared.strip().isdigit() and int(declared) > self.max_body_bytes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_request_id(send, request_id(scope))
        path = scope["path"]
        if path not in OPEN_PATHS:
            denied = self._denied(scope)
            if denied is not None:
                status, message, code = denied
                body = error_body(message, "authentication_error" if status == 401
                                  else "permission_error", None, code)
                await _send_json(send, status, body, [(b"www-authenticate", b"Bearer")])
                return
            # at once, not after waiting for the body; and no 503 a client would retry
            if self._declared_too_large(scope):
                body = error_body(f"request body is over {self.max_body_bytes >> 20} MiB",
                                  "invalid_request_error", None, "request_too_large")
                await _send_json(send, 413, body, [(b"connection", b"close")])
                return
            if not self.lifecycle.serving:
                body = error_body(self.lifecycle.unavailable_reason(), "service_unavailable",
                                  None, self.lifecycle.phase.value)
                await _send_json(send, 503, body,
                                 [(b"retry-after", str(RETRY_AFTER_S).encode())])
                return
        if path not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        self.lifecycle.request_started()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.request_finished()
