"""One request on the engine: validated inputs in, chunks out, metrics recorded on the way.

Every endpoint (chat, completions, /generate) goes through `EngineRun`, so the Prometheus series
mean the same thing whichever API a client used. Closing a run (a client that disconnects, a
cancelled handler) closes the engine's stream, which aborts the request in the core and frees its
KV at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from starlette.requests import Request

from radixpool.protocol.errors import NO_RETRY, NONFINITE_LOGITS
from radixpool.worker.engine_errors import RequestFault, RidInUse
from radixpool.worker.sampling_params import SamplingParams, over_model_defaults
from radixpool.worker.server.errors import APIError, bad_request, unavailable
from radixpool.worker.server.state import WorkerState

T = TypeVar("T")

SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
_UNKNOWN_FIELD = re.compile(r"unknown sampling field '(\w+)'")
_LEADING_NAME = re.compile(r"^([a-z_]+)\b")
_OVER_KV = re.compile(r"^the prompt has \d+ tokens; this worker takes at most")  # the core's


def engine_error(exc: ValueError, renames: dict[str, str], default_param: str | None) -> APIError:
    """A ValueError from validation → 400 whose `param` is the API's name for the field."""
    message = str(exc)
    unknown = _UNKNOWN_FIELD.match(message)
    lead = _LEADING_NAME.match(message)
    if unknown:
        param = unknown.group(1)
    elif lead and lead.group(1) in SAMPLING_FIELDS:
        name = lead.group(1)
        param = renames.get(name, name)
        message = param + message[len(name):]
    else:
        param = default_param
    # a prompt longer than the KV pool is refused like one longer than the context
    code = "context_length_exceeded" if _OVER_KV.match(message) else None
    return bad_request(message, param=param, code=code)



def build_params(doc: dict[str, Any], vocab_size: int, renames: dict[str, str],
                 prefix: str = "", defaults: dict[str, Any] | None = None) -> SamplingParams:
    """`doc`'s params; the fields it leaves out take `defaults` (the model's
    generation_config.json sampling fields), then the engine's."""
    try:
        params = SamplingParams.from_dict(over_model_defaults(doc, defaults or {}))
        params.check_vocab(vocab_size)
    except (ValueError, TypeError) as exc:
        err = engine_error(ValueError(str(exc)), renames, None)
        if prefix and err.param:
            err.param = f"{prefix}{err.param}"
        raise err from None
    return params


@dataclass
class ForkOutput:
    """Everything one fork (choice) produced, accumulated from its chunks."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    trimmed_stop_token: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    core_seconds: float | None = None

    def add(self, chunk: Any) -> None:
        if chunk.text:
            self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        if chunk.top_logprobs:
            self.top_logprobs.extend(chunk.top_logprobs)
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        self.cached_tokens = chunk.cached_tokens or self.cached_tokens
        self.completion_tokens = chunk.completion_tokens or self.completion_tokens
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            self.matched_stop = chunk.matched_stop
            self.trimmed_stop_token = chunk.trimmed_stop_token
            self.core_seconds = chunk.core_seconds

    @property
    def full_text(self) -> str:
        return "".join(self.text)


class EngineRun:
    """An engine stream with metrics. Start it with `await run.first()` (raises 400 on bad input),
    then iterate; `close()` aborts it if it has not finished."""

    def __init__(self, state: WorkerState, input_ids: list[int], params: SamplingParams,
                 namespace: str | None, rid: str, renames: dict[str, str] | None = None,
                 prompt_param: str | None = None) -> None:
        self.rid = rid
        self._stream = state.engine.stream(input_ids=input_ids, sampling_params=params,
                                           namespace=namespace, rid=rid)
        self._engine = state.engine
        self._metrics = state.metrics
        self._watch = state.nonfinite_watch
        self._lifecycle = state.lifecycle
        self._active = state.active_rids
        self._active[rid] += 1
        self._holds_rid = True
        self._renames = renames or {}
        self._prompt_param = prompt_param
        self._last: dict[int, float] = {}
        self._latest: dict[int, Any] = {}   # each choice's last chunk: its token counts so far
        self._open = set(range(params.n))
        self._start = time.time()
        self._first: Any = None

    async def first(self) -> None:
        try:
            self._first = await self._stream.__anext__()
        except ValueError as exc:
            self._open.clear()   # refused, not aborted: it is no finished request
            await self.close()
            if isinstance(exc, RidInUse):
                raise bad_request(str(exc), param="rid", code="duplicate_rid") from None
            raise engine_error(exc, self._renames, self._prompt_param) from None
        except RequestFault as exc:
            raise self._faulted(exc) from None
        except RuntimeError:
            if self._engine.alive:
                raise
            self._open.clear()
            await self.close()
            raise _core_died() from None
        except StopAsyncIteration:
            self._first = None
        if self._first is not None:
            self._observe(self._first)
            if self._lifecycle.drain_expired and self._first.finish_reason == "abort" \
                    and not self._first.completion_tokens:
                # cut by the drain before its first token: nothing is sent yet, so it can go
                # elsewhere, where a 200 ending in "abort" with no text could not
                await self.close()
                raise _drained() from None

    def _observe(self, chunk: Any) -> None:
        now = time.time()
        self._latest[chunk.index] = chunk
        if chunk.token_ids:   # a choice aborted before its first token has no TTFT
            # every token after a choice's first has one gap: a chunk's k tokens share the time
            # since the last chunk; those that came with the first token came with no gap
            prev = self._last.get(chunk.index)
            tokens = len(chunk.token_ids)
            if prev is None:
                self._metrics.record_first_token(
                    (chunk.first_token_time or now) - chunk.arrival_time, chunk.queue_time)
                self._metrics.record_token_gap(0.0, tokens - 1)
            else:
                self._metrics.record_token_gap((now - prev) / tokens, tokens)
            self._last[chunk.index] = now
        if chunk.finished:
            self._watch.finished(nonfinite=False, produced=chunk.completion_tokens > 0)
            self._open.discard(chunk.index)
            self._metrics.record_finished(chunk.finish_reason, chunk.prompt_tokens,
                                          chunk.cached_tokens, chunk.completion_tokens,
                                          now - chunk.arrival_time)

    def _faulted(self, exc: RequestFault) -> APIError:
        """The engine failed this request alone: a 500 whose code tells a gateway so, and that
        tells the OpenAI SDKs not to send it again (by default they retry a 500 twice)."""
        self._watch.finished(nonfinite=exc.code == NONFINITE_LOGITS, produced=False)
        return APIError(500, str(exc), code=exc.code, headers=dict([NO_RETRY]))

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            if self._first is not None:
                yield self._first
                self._first = None
                async for chunk in self._stream:
                    self._observe(chunk)
                    yield chunk
        except ValueError as exc:   # refused after its first tokens (its grammar failed on it)
            raise engine_error(exc, self._renames, self._prompt_param) from None
        except RequestFault as exc:
            raise self._faulted(exc) from None
        except RuntimeError:
            if self._engine.alive:
                raise
            raise _core_died() from None
        finally:
            await self.close()

    async def close(self) -> None:
        if self._holds_rid:
            self._holds_rid = False
            self._active[self.rid] -= 1
            if not self._active[self.rid]:
                del self._active[self.rid]
        await self._stream.aclose()
        now = time.time()
        for index in self._open:
            latest = self._latest.get(index)
            if latest is None:   # no token yet: what its prefill computed is not known here
                self._metrics.record_aborted(now - self._start)
            else:
                self._metrics.record_aborted(now - self._start, latest.prompt_tokens,
                                             latest.cached_tokens, latest.completion_tokens)
        self._open.clear()

    @property
    def finished(self) -> bool:
        """Every choice has finished (e.g. a one-token request, after `first()`)."""
        return not self._open

    async def collect(self) -> list[ForkOutput]:
        """The whole answer (for a response that is not streamed). One the worker's shutdown cut
        short is a 503 `draining`: a gateway (or the SDK) sends it again, to another worker,
        instead of taking a truncated text for a finished one."""
        forks: dict[int, ForkOutput] = {}
        async for chunk in self:
            forks.setdefault(chunk.index, ForkOutput(chunk.index)).add(chunk)
        if self._lifecycle.drain_expired and any(
                fork.finish_reason == "abort" for fork in forks.values()):
            raise _drained()
        return [forks[i] for i in sorted(forks)]


def _drained() -> APIError:
    return unavailable("this worker shut down before the request finished (its drain timeout "
                       "passed); send it again", retry_after_s=1, code="draining")


def _core_died() -> APIError:
    # 503, so a gateway retries it on another worker; /health says why, and the worker exits.
    # The code tells a gateway the engine died holding this request (a query of death, twice).
    return unavailable("the engine core process died; this worker cannot serve",
                       code="engine_core_died")


def server_timing(forks: list[ForkOutput]) -> dict[str, str]:
    """A `Server-Timing` header for a whole response: `engine;dur=MS` is the longest time any of
    its choices spent in the engine core (queue + prefill + decode). The rest of the latency a
    client sees is the server (HTTP, tokenizers, IPC) and the network."""
    times = [fork.core_seconds for fork in forks if fork.core_seconds is not None]
    return {"Server-Timing": f"engine;dur={max(times) * 1000:.3f}"} if times else {}


async def merge_streams(runs: list[EngineRun]) -> AsyncIterator[tuple[int, Any]]:
    """Chunks of several runs as they come, tagged with the run's position."""
    if len(runs) == 1:
        async for chunk in runs[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, run: EngineRun) -> None:
        try:
            async for chunk in run:
                await queue.put((i, chunk))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(runs)]
    try:
        remaining = len(runs)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
                for task in tasks:   # surface a pump's error instead of waiting forever
                    if task.done() and not task.cancelled() and task.exception():
                        raise task.exception()
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for run in runs:
            await run.close()


async def start_all(request: Request, runs: list[EngineRun]) -> None:
    """Start every run at once, so the engine batches them (one after another, each prompt
    waited for the one before it to reach its first token), and wait for their first tokens: a
    bad request is refused with a 400 by then. If one is rejected, close the others and
    re-raise the first refusal in the batch's order; if the client leaves meanwhile, abort
    them all (a long prompt waiting or in prefill is not computed for nobody)."""
    async def first_tokens() -> None:
        tasks = [asyncio.ensure_future(run.first()) for run in runs]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
            if failed:
                raise failed[0].exception()
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for run in runs:
                await run.close()
            raise

    await until_disconnect(request, first_tokens(), runs)


async def until_disconnect(request: Request, work: Awaitable[T], runs: list[EngineRun]) -> T:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client leaves.
    Runs that already finished have nothing left to abort: no watcher then."""
    if all(run.finished for run in runs):
        return await work
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for run in runs:   # `work` may have reached only some of them (one prompt at a time)
                await run.close()
            raise APIError(499, "client closed the request", code="client_disconnected")
    return task.result()
