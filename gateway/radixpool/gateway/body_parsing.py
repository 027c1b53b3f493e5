"""A routed request's body to its route key: small bodies in place, large ones in child processes.

`json.loads` holds the GIL for the whole parse, and its cost grows with the number of values in
the body, not only its size: 32 MiB of `{"x": [[1], [1], ...]}` takes seconds and more than half
a GiB, while 32 MiB of one prompt string takes 70 ms. Rendering a chat template is Python too.
Done in the gateway's own process, on a thread or not, such a body stops every other request for
as long as it takes, and two at once can take the gateway past its memory limit.

So bodies above `INLINE_BODY_BYTES` are parsed, validated and keyed in a pool of child processes
(`--parse-processes`, started on the first large body and whenever the keys change, e.g. when a
worker's tokenizer arrives). The event loop only hands the bytes over and gets back the route key
and the body to forward. Each child may grow by `--parse-memory-bytes` beyond what it holds once
started (`RLIMIT_DATA`) and asks the kernel to kill it before the gateway when memory runs out. A
body that cannot be parsed within that limit gets a 413; a child that dies takes only the bodies
it held, which are tried once more on a fresh pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import resource
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from radixpool.gateway.route_key import BadRequest, KeyBuilder, RouteKey

log = logging.getLogger("radixpool.gateway")

INLINE_BODY_BYTES = 16 * 1024  # worst case in place: a few ms of parsing and tokenization
USAGE_OPTION = b'"stream_options":{"include_usage":true},'


class BodyTooComplex(Exception):
    """The body could not be parsed within the parse processes' memory limit: answered 413."""


@dataclass(slots=True)
class ParsedBody:
    key: RouteKey
    body: bytes         # what the worker is sent
    strip_usage: bool   # the stream's usage event was asked for by the gateway, not the client


def parse_body(keys: KeyBuilder, path: str, body: bytes) -> ParsedBody:
    """Validate a routed request's body and build its route key; raises `BadRequest`.

    Streams ask the worker for `stream_options.include_usage`, so every answer reports
    `cached_tokens`: the option is spliced in (no re-encoding) when the client sent none."""
    try:
        # UTF-8 only (RFC 8259): `json.loads(bytes)` would also take UTF-16 and -32, which the
        # splice below and the workers do not
        doc = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise BadRequest(f"request body is not valid JSON: {reason}",
                         code="invalid_json") from None
    key = keys.build(path, doc)
    if doc.get("stream") is not True or path == "/generate":
        return ParsedBody(key, body, False)
    options = doc.get("stream_options")
    if options is None:  # the object has a "stream" member: open it with the option
        start = body.index(b"{") + 1
        return ParsedBody(key, body[:start] + USAGE_OPTION + body[start:], True)
    if isinstance(options, dict) and not options.get("include_usage"):
        doc["stream_options"] = {**options, "include_usage": True}
        return ParsedBody(key, json.dumps(doc).encode(), True)
    return ParsedBody(key, body, False)


class BodyParser:
    def __init__(self, keys: KeyBuilder, processes: int, memory_bytes: int) -> None:
        self.keys = keys
        self.processes = processes
        self.memory_bytes = memory_bytes
        self._pool: ProcessPoolExecutor | None = None
        self._generation = -1   # the keys' generation the pool's children were started with

    async def parse(self, path: str, body: bytes) -> ParsedBody:
        """Raises `BadRequest` (400) or `BodyTooComplex` (413)."""
        if len(body) <= INLINE_BODY_BYTES:
            return parse_body(self.keys, path, body)
        loop = asyncio.get_running_loop()
        for _ in range(2):   # a child killed while it held this body and others: once more
            pool = self._current_pool()
            try:
                return await loop.run_in_executor(pool, _parse_in_child, path, body)
            except MemoryError:
                break
            except BrokenProcessPool:
                self._discard(pool)
        raise BodyTooComplex(f"request body could not be parsed within the gateway's parse "
                             f"memory limit of {self.memory_bytes} bytes")

    def _current_pool(self) -> ProcessPoolExecutor:
        if self._pool is None or self._generation != self.keys.generation:
            if self._pool is not None:
                self._pool.shutdown(wait=False)   # its children finish what they hold, then end
            self._generation = self.keys.generation
            self._pool = ProcessPoolExecutor(
                self.processes, mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_child, initargs=(self.keys.settings(), self.memory_bytes))
        return self._pool

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        log.warning("a body-parsing process died; starting new ones")
        if pool is self._pool:
            self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


# --- in the child processes ---------------------------------------------------------------------
_child_keys: KeyBuilder | None = None


def _start_child(settings: tuple, memory_bytes: int) -> None:
    global _child_keys
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the gateway's to handle
    _child_keys = KeyBuilder.from_settings(settings)
    # first to go when the pod runs out of memory
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    used = _data_bytes()
    if used is not None:
        limit = used + memory_bytes
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _parse_in_child(path: str, body: bytes) -> ParsedBody:
    assert _child_keys is not None
    return parse_body(_child_keys, path, body)


def _data_bytes() -> int | None:
    """This process's data segment as `RLIMIT_DATA` counts it (`VmData`), None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
