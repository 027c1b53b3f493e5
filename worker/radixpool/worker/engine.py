"""The offline and serving API of the engine: `Engine(model_path, ...)`.

The engine core (scheduler, cache, model) runs in its own process; this front end tokenizes,
sends requests over a Unix socket pair (`ipc.py`), and turns the core's token deltas back into
text — on a receiver thread, or on a server's event loop once `bind_loop` is called:
incremental detokenization (never a broken UTF-8 character), stop strings (trimmed even when
split across tokens; the core is told to stop), `n` forks (separate core requests sharing the
prompt's KV through the radix tree), logprobs. Three ways to call it:
- `generate(...)`: blocking, one prompt or a batch; returns dicts;
- `stream(...)`: an async iterator of `StreamChunk`s (leaving it early aborts the request);
- `generate_async(...)`: the async non-streaming form.
Invalid input raises `ValueError` naming the field before anything reaches the core.

A watchdog thread kills a core that says nothing for `watchdog_timeout_s` while requests or
controls wait on it (a busy core speaks at least every second, `core_process.HEARTBEAT_S`): a
step stuck in a hung GPU or a deadlock then ends like a crashed core, its requests failed (a
gateway retries them elsewhere) and the worker restarted, instead of every request hanging
behind it with the worker's health still 200. `stall` says why it was killed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import fields
from typing import Any

from radixpool.protocol.errors import OUTPUT_DECODE_FAILED
from radixpool.tokenization import PromptTokenizer
from radixpool.worker.config import EngineConfig
from radixpool.worker.core_process import Shutdown
from radixpool.worker.detokenizer import IncrementalDetokenizer
from radixpool.worker.engine_errors import EngineBusy, EngineStartCancelled, RidInUse
from radixpool.worker.ipc import Inbox, Outbox, PeerClosed, frame, socket_pair
from radixpool.worker.kv_event_log import KVEventLog
from radixpool.worker.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    CoreFailed,
    CoreReady,
    EngineStats,
    GenerateRequest,
    StepOutput,
    TokenDelta,
)
from radixpool.worker.request_output import RequestOutput, StreamChunk, result_from_chunks
from radixpool.worker.sampler import request_seed
from radixpool.worker.sampling_params import SamplingParams, over_model_defaults
from radixpool.worker.stop_strings import StopMatcher

__all__ = ["Engine", "EngineBusy", "EngineStartCancelled", "RidInUse", "StreamChunk"]

log = logging.getLogger("radixpool.engine")
CONTROL_TIMEOUT_S = 600.0


class Engine:
    def __init__(self, model_path: str, *, cancel: threading.Event | None = None,
                 **options: Any) -> None:
        """Start the engine: returns once its core process has loaded the model. Setting
        `cancel` (from another thread) while it loads stops the core and raises
        `EngineStartCancelled`."""
        self._cancel = cancel
        known = {f.name for f in fields(EngineConfig)} - {"model_path"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown Engine option {unknown[0]!r}; "
                             f"expected one of: {', '.join(sorted(known))}")
        self.config = EngineConfig(model_path=str(model_path), **options)
        self.tokenizer = PromptTokenizer.from_dir(self.config.model_path)
        self.kv_events = KVEventLog()
        self.instance_id = uuid.uuid4().hex
        self._forks: dict[str, RequestOutput] = {}   # by core rid, until finished
        # caller's rid -> the core rids of its request's forks still in `_forks`; an aborted
        # request gives its rid up at once (its forks' late output is keyed by core rid)
        self._open_rids: dict[str, set[str]] = {}
        # Core rids are the caller's plus a submission number: a rid reused as soon as its
        # request finished here (a stop string ends it before the core hears of the abort)
        # never meets the old request's late output, nor the old request itself, in the core.
        self._submissions = itertools.count()
        self._controls: dict[int, concurrent.futures.Future] = {}
        self._tokens = itertools.count(1)
        self._stats: EngineStats | None = None
        self._loop: asyncio.AbstractEventLoop | None = None   # see bind_loop
        self._loop_thread = 0
        self._receiver_stop = threading.Event()
        self._dead = False   # the core process exited under us
        self._heard_at = time.monotonic()   # the core's last message
        self.stall: str | None = None   # why the watchdog killed the core
        self._send_lock = threading.Lock()
        self._deferred_lock = threading.Lock()  # fork hand-off: receiver thread vs abort()
        self._closed = False
        self._start_core()

    # ------------------------------------------------------------------ process
    def _start_core(self) -> None:
        self._sock, core_end = socket_pair()
        self._inbox = Inbox(self._sock)
        self._outbox = Outbox(self._sock)
        self._writer_loop: asyncio.AbstractEventLoop | None = None   # see _send
        # A fresh interpreter (not multiprocessing's spawn): it never re-imports the caller's
        # main module, so scripts need no `if __name__ == "__main__"` guard.
        with core_end:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "radixpool.worker.core_process",
                 json.dumps(dataclasses.asdict(self.config)), str(core_end.fileno()),
                 str(os.getpid())],
                stdin=subprocess.DEVNULL, pass_fds=(core_end.fileno(),))
        self._finalizer = weakref.finalize(self, _kill, self._process, self._sock)
        self.info = self._await_ready()
        self._stats = self.info.stats
        self._receiver = threading.Thread(target=self._receive_loop, name="radixpool-receiver",
                                          daemon=True)
        self._receiver.start()
        self._watchdog = threading.Thread(target=self._watch, name="radixpool-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        """Kill the core once it has said nothing for `watchdog_timeout_s` with work given."""
        limit = self.config.watchdog_timeout_s
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        busy_since: float | None = None
        while not (self._closed or self._dead):
            time.sleep(min(1.0, limit / 4))
            if not (self._forks or self._controls):
                busy_since = None
                continue
            now = time.monotonic()
            if busy_since is None:
                busy_since = now
            if poller.poll(0):   # it spoke, and the front end has not read it yet
                self._heard_at = now
            silent = now - max(self._heard_at, busy_since)
            if silent >= limit and self._process.poll() is None and not self._closed:
                self.stall = (f"the engine core made no progress for {silent:.0f} s with "
                              f"requests in flight (--watchdog-timeout {limit:g}); it was "
                              "killed")
                log.error("%s", self.stall)
                self._process.kill()
                return

    def _await_ready(self) -> CoreReady:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if self._inbox.wait(0.2):
                try:
                    messages = self._inbox.read()
                except PeerClosed:
                    messages = []
                for msg in messages:   # the core sends nothing else before either of these
                    if isinstance(msg, CoreReady):
                        return msg
                    if isinstance(msg, CoreFailed):
                        self._finalizer()
                        raise RuntimeError(f"engine core failed to start: {msg.error}")
            if self._process.poll() is not None:
                self._finalizer()
                raise RuntimeError(f"engine core exited with code {self._process.returncode} "
                                   "before it was ready")
            if self._cancel is not None and self._cancel.is_set():
                self._finalizer()
                raise EngineStartCancelled("the engine's start was cancelled while the model "
                                           "loaded")
        self._finalizer()
        raise RuntimeError(f"engine core not ready after {self.config.startup_timeout_s:g} s "
                           "(--startup-timeout)")

    def _send(self, msg: Any) -> None:
        """Messages reach the core whole and in order. What the socket does not take now (the
        core reads between steps) is written by the bound event loop when the socket has room:
        the loop never waits on the core. Without a loop, the caller waits here."""
        data = frame(msg)
        with self._send_lock:
            if self._dead:
                raise RuntimeError("the engine core process died")
            try:
                self._outbox.push(data)
                if self._outbox.pending:
                    self._finish_write()
            except (PeerClosed, OSError):
                raise RuntimeError("the engine core process died") from None

    def _finish_write(self) -> None:   # under _send_lock
        loop = self._loop
        if loop is None or loop.is_closed():
            self._outbox.drain(None)
        elif threading.get_ident() == self._loop_thread:
            self._arm_writer(loop)
        else:
            loop.call_soon_threadsafe(self._on_writable)   # on the loop: writes, or arms

    def _arm_writer(self, loop: asyncio.AbstractEventLoop) -> None:   # on loop's thread
        if self._writer_loop is None:
            loop.add_writer(self._sock.fileno(), self._on_writable)
            self._writer_loop = loop

    def _on_writable(self) -> None:
        with self._send_lock:
            try:
                self._outbox.flush()
            except (PeerClosed, OSError):   # the core is gone: the reader sees the pipe end
                self._outbox.clear()
            if self._outbox.pending and self._loop is not None:
                self._arm_writer(self._loop)
            else:
                self._disarm_writer()

    def _disarm_writer(self) -> None:   # under _send_lock
        loop, self._writer_loop = self._writer_loop, None
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(Exception):   # the loop may be gone with its selector
                loop.remove_writer(self._sock.fileno())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._send(Shutdown())
            with self._send_lock, contextlib.suppress(PeerClosed, OSError):
                self._outbox.drain(10)   # the loop may never run again to finish the write
            self._process.wait(timeout=10)
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        finally:
            self._receiver.join(timeout=2)
            self._unbind_loop()
            self._finalizer()
        for fork in list(self._forks.values()):
            self._finish_fork(fork, "abort", error="the engine was shut down", internal=True)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def live_requests(self) -> int:
        """Sequences submitted and not finished (each choice of an `n` > 1 request is one): the
        load the `/kv_events` stream reports."""
        return len(self._forks)

    @property
    def alive(self) -> bool:
        return not (self._closed or self._dead) and self._process.poll() is None

    @property
    def core_exit_code(self) -> int | None:
        """The core process's exit status once it has ended (negative: killed by that signal)."""
        return self._process.poll()

    # ------------------------------------------------------------------ receiving
    def _receive_loop(self) -> None:
        while not self._closed and not self._receiver_stop.is_set():
            if self._inbox.wait(0.2) and not self._read():
                return

    def _read(self) -> bool:
        """Handle every message that has arrived; False once the core is gone (its process
        exiting, however it ends, closes its end of the pipe)."""
        try:
            messages = self._inbox.read()
        except (PeerClosed, OSError):
            if not self._closed:
                self._core_died()
            return False
        if messages:
            self._heard_at = time.monotonic()
        for msg in messages:
            self._handle(msg)
        return True

    def bind_loop(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Receive the core's output on `loop` (the running one by default) instead of a
        thread. A server calls this once from its event loop: every chunk then reaches its
        stream without a thread hop and a cross-thread wake-up. Afterwards the blocking calls
        (`generate`, `flush_cache`, `probe`, ...) must not run on that loop's thread (they would
        wait on the loop they block); their `_async` forms are for it."""
        loop = loop or asyncio.get_running_loop()
        if self._loop is not None:
            raise RuntimeError("the engine is already bound to an event loop")
        self._receiver_stop.set()
        self._receiver.join()
        self._loop, self._loop_thread = loop, threading.get_ident()
        loop.add_reader(self._sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        if not self._read():
            self._unbind_loop()

    def _unbind_loop(self) -> None:
        with self._send_lock:
            self._disarm_writer()
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(Exception):   # the loop may be gone with its selector
            loop.remove_reader(self._sock.fileno())

    def _blocking_allowed(self, what: str) -> None:
        if self._loop is not None and threading.get_ident() == self._loop_thread:
            raise RuntimeError(f"{what} blocks; on the engine's event loop use its async form")

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, StepOutput):
            self.kv_events.append(msg.events)
            if msg.stats is not None:
                self._stats = msg.stats
            for delta in msg.deltas:
                fork = self._forks.get(delta.rid)
                if fork is not None:
                    try:
                        self._apply(fork, delta)
                    except Exception as exc:
                        self._output_failed(fork, delta, exc)
        elif isinstance(msg, ControlReply):
            fut = self._controls.pop(msg.token, None)
            if fut is not None:
                if msg.ok:
                    fut.set_result(msg.payload)
                else:
                    fut.set_exception(RuntimeError(msg.error))

    def _core_died(self) -> None:
        with self._send_lock:
            if self._dead:
                return
            self._dead = True
        for fork in list(self._forks.values()):
            self._finish_fork(fork, "abort", error="the engine core process died", internal=True)
        for fut in self._controls.values():
            fut.set_exception(RuntimeError("the engine core process died"))
        self._controls.clear()

    def _apply(self, fork: RequestOutput, delta: TokenDelta) -> None:
        if fork.deferred:
            self._release_forks(fork, delta)
        chunk, stop_matched = fork.apply(delta)
        if stop_matched and not delta.finished:
            self._send(AbortRequest(fork.core_rid))  # a stop string ended it: stop the core
        if chunk.finished:
            self._drop(fork)
        _deliver(fork, chunk)

    def _output_failed(self, fork: RequestOutput, delta: TokenDelta, exc: Exception) -> None:
        """Turning one request's tokens into output failed (a bug meeting odd tokens): that
        request ends with an internal error. The other deltas of the step are still handled."""
        log.error("request %s: its output could not be decoded", fork.rid, exc_info=exc)
        if not delta.finished:
            with contextlib.suppress(RuntimeError):   # a core that died says so on its own
                self._send(AbortRequest(fork.core_rid))
        self._drop(fork)
        _deliver(fork, fork.fail("abort", f"the engine failed to decode this request's output "
                                          f"({type(exc).__name__}: {exc})", internal=True,
                                 code=OUTPUT_DECODE_FAILED))

    def _release_forks(self, first: RequestOutput, delta: TokenDelta) -> None:
        """Send the sibling forks held back behind `first`, or end them if it ended early."""
        with self._deferred_lock:
            deferred, first.deferred = first.deferred, []
            if delta.error is None and delta.finish_reason != "abort":
                # sent under the lock: an abort from another thread finds them held or sent,
                # never taken and not yet sent (its AbortRequest would reach the core first)
                for request in deferred:
                    self._send(request)
                return
        for request in deferred:  # refused, aborted or faulted before its prompt was cached
            sibling = self._forks.get(request.rid)
            if sibling is not None:   # the same prompt: the same answer (a fault stays one)
                self._finish_fork(sibling, "abort", delta.error, delta.internal_error,
                                  delta.error_code)

    def _finish_fork(self, fork: RequestOutput, reason: str, error: str | None,
                     internal: bool = False, code: str | None = None) -> None:
        if not fork.finished:
            self._drop(fork)
            _deliver(fork, fork.fail(reason, error, internal, code=code))

    def _drop(self, fork: RequestOutput) -> None:
        if self._forks.pop(fork.core_rid, None) is not None:
            self.kv_events.touch()
        self._release_rid(fork)

    def _release_rid(self, fork: RequestOutput) -> None:
        """The fork no longer holds its rid; the rid is free once none of its request's do."""
        live = self._open_rids.get(fork.rid)
        if live is not None and fork.core_rid in live:   # else a request with the rid since
            live.discard(fork.core_rid)
            if not live:
                self._open_rids.pop(fork.rid, None)

    # ------------------------------------------------------------------ validation
    def _prepare(self, prompt: Any, input_ids: Any) -> list[list[int]]:
        """Token ids of each prompt (a batch is a list); ValueError naming the field."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) or input_ids")
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else prompt
            if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a list of strings")
            if any(not p for p in prompts):
                raise ValueError("prompt is empty")
            batch = [self.tokenizer.encode(p) for p in prompts]
            name = "prompt"
        else:
            batch = input_ids if input_ids and isinstance(input_ids[0], list) else [input_ids]
            name = "input_ids"
            vocab = self.info.vocab_size
            for ids in batch:
                # C-level passes over the list: no per-token Python bytecode on long prompts.
                if not isinstance(ids, list) or (ids and (
                        set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= vocab)):
                    raise ValueError(f"input_ids must be lists of token ids in [0, {vocab})")
        if not batch:
            raise ValueError(f"{name} must not be an empty list")
        limit = self.info.context_length
        for ids in batch:
            if not ids:
                raise ValueError(f"{name} is empty")
            if len(ids) >= limit:
                raise ValueError(f"{name} has {len(ids)} tokens; the context length is {limit}, "
                                 "which must also leave room for at least one new token")
        return batch

    def _params(self, sampling_params: Any, count: int) -> list[SamplingParams]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != count:
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for "
                                 f"{count} prompts")
            items = sampling_params
        else:
            items = [sampling_params] * count
        out = []
        for item in items:
            params = (item if isinstance(item, SamplingParams)
                      else SamplingParams.from_dict(
                          over_model_defaults(item, self.info.sampling_defaults)))
            params.check_vocab(self.info.vocab_size)
            out.append(params)
        return out

    # ------------------------------------------------------------------ submitting
    def _submit(self, ids: list[int], params: SamplingParams, namespace: str | None,
                rid: str | None, sink: Callable[[StreamChunk], None]) -> list[RequestOutput]:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        rid = rid or uuid.uuid4().hex
        if rid in self._open_rids:
            raise RidInUse(rid)
        # unique: the number after the last "#" is this submission's alone
        tag = f"{rid}#{next(self._submissions)}"
        core_rids = [tag] if params.n == 1 else [f"{tag}/{i}" for i in range(params.n)]
        now = time.time()
        forks, requests = [], []
        for i, core_rid in enumerate(core_rids):
            stop = StopMatcher(params.stop, params.no_stop_trim) if params.stop else None
            fork = RequestOutput(core_rid, rid, i, params,
                                 IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                                        ids),
                                 stop, sink, now)
            self._forks[core_rid] = fork
            forks.append(fork)
            requests.append(GenerateRequest(core_rid, ids, params, request_seed(params.seed, i),
                                            namespace, now))
        # Fork 0 goes first; the others follow once its prompt is in the radix cache (its first
        # token), so every fork reuses the prompt's KV whatever its length.
        self._open_rids[rid] = set(core_rids)
        forks[0].deferred = requests[1:]
        self._send(requests[0])
        self.kv_events.touch()
        return forks

    def abort(self, rid: str) -> None:
        """Stop a request (all its choices); its KV is freed at once, and its rid may be reused
        at once."""
        live = list(self._open_rids.get(rid, ()))
        self._abort_forks([fork for core_rid in live
                           if (fork := self._forks.get(core_rid)) is not None])

    def _abort_forks(self, forks: list[RequestOutput]) -> None:
        forks = [fork for fork in forks if fork.core_rid in self._forks]   # not finished yet
        for fork in forks:   # their late output is keyed by core rid: none reaches a newcomer
            self._release_rid(fork)
        with self._deferred_lock:
            held = {r.rid for f in forks for r in f.deferred}
            for fork in forks:
                fork.deferred = []
        for fork in forks:
            if fork.core_rid in held:
                self._finish_fork(fork, "abort", None)  # never reached the core
            else:
                self._send(AbortRequest(fork.core_rid))

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | SamplingParams | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 namespace: str | None = None) -> dict | list[dict]:
        """Blocking generation. One prompt and n=1 gives a dict; otherwise a list of dicts
        (each prompt's n choices in order)."""
        self._blocking_allowed("generate")
        batch = self._prepare(prompt, input_ids)
        params = self._params(sampling_params, len(batch))
        done = threading.Event()
        chunks: dict[tuple[str, int], list[StreamChunk]] = {}
        remaining = [sum(p.n for p in params)]

        def sink(chunk: StreamChunk) -> None:  # runs where the core's output is read
            chunks.setdefault((chunk.rid, chunk.index), []).append(chunk)
            if chunk.finished:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

        forks: list[RequestOutput] = []
        for ids, p in zip(batch, params):
            forks.extend(self._submit(ids, p, namespace, None, sink))
        while not done.wait(0.5) and not self._closed:
            pass
        out = []
        for fork in forks:
            got = chunks.get((fork.rid, fork.index), [])
            if got:
                got[-1].raise_error()
            out.append(result_from_chunks(got))
        single = len(batch) == 1 and params[0].n == 1 and (
            isinstance(prompt, str) or (input_ids is not None and not
                                        (input_ids and isinstance(input_ids[0], list))))
        return out[0] if single else out

    async def stream(self, prompt: str | None = None,
                     sampling_params: dict | SamplingParams | None = None,
                     input_ids: list[int] | None = None, namespace: str | None = None,
                     rid: str | None = None) -> AsyncIterator[StreamChunk]:
        """Stream one prompt's chunks (all n choices interleaved, `chunk.index` tells which).

        Raises ValueError (bad input) before the first chunk, RuntimeError if the core refused
        or lost the request. Leaving the iteration early aborts whatever is unfinished.
        """
        if isinstance(prompt, list) or (input_ids and isinstance(input_ids[0], list)):
            raise ValueError("stream takes one prompt")
        ids = self._prepare(prompt, input_ids)[0]
        params = self._params(sampling_params, 1)[0]
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamChunk] = asyncio.Queue()

        def sink(chunk: StreamChunk) -> None:
            # The caller's loop may be gone (it stopped iterating and closed): drop the chunk.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, chunk)

        if loop is self._loop:
            sink = queue.put_nowait   # delivered on this very loop: no wake-up needed

        forks = self._submit(ids, params, namespace, rid, sink)
        open_forks = len(forks)
        try:
            while open_forks:
                chunk = await queue.get()
                chunk.raise_error()
                open_forks -= chunk.finished
                yield chunk
        finally:
            if any(not fork.finished for fork in forks):
                self._abort_forks(forks)   # its own forks: the rid may name a newer request

    async def generate_async(self, prompt: str | None = None,
                             sampling_params: dict | SamplingParams | None = None,
                             input_ids: list[int] | None = None, namespace: str | None = None,
                             rid: str | None = None) -> dict | list[dict]:
        forks: dict[int, list[StreamChunk]] = {}
        async for chunk in self.stream(prompt, sampling_params, input_ids, namespace, rid):
            forks.setdefault(chunk.index, []).append(chunk)
        out = [result_from_chunks(forks[i]) for i in sorted(forks)]
        return out[0] if len(out) == 1 else out

    # ------------------------------------------------------------------ control
    def _control_future(self, kind: str, payload: Any = None) -> concurrent.futures.Future:
        token = next(self._tokens)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._controls[token] = fut
        self._send(ControlRequest(kind, token, payload))  # type: ignore[arg-type]
        return fut

    def _control(self, kind: str, payload: Any = None) -> Any:
        self._blocking_allowed(kind)
        return self._control_future(kind, payload).result(timeout=CONTROL_TIMEOUT_S)

    async def _control_async(self, kind: str, payload: Any = None) -> Any:
        return await asyncio.wrap_future(self._control_future(kind, payload))

    def flush_cache(self) -> None:
        """Empty the radix cache; new `instance_id`. Only while idle: with requests running or
        waiting it raises `EngineBusy` at once and changes nothing."""
        self._flushed(self._control("flush_cache"))

    async def flush_cache_async(self) -> None:
        self._flushed(await self._control_async("flush_cache"))

    def _flushed(self, busy: dict[str, int] | None) -> None:
        if busy is not None:
            raise EngineBusy(busy["running"], busy["waiting"])
        self.instance_id = uuid.uuid4().hex

    def probe(self, input_ids: list[int], namespace: str | None = None) -> int:
        """How many leading tokens of `input_ids` the radix cache holds now (read-only)."""
        return self._control("probe", (list(input_ids), namespace))

    async def probe_async(self, input_ids: list[int], namespace: str | None = None) -> int:
        return await self._control_async("probe", (list(input_ids), namespace))

    def kv_snapshot(self) -> tuple[int, list[int]]:
        """(seq, every block hash the cache holds as of event `seq`)."""
        return self._control("kv_snapshot")

    async def kv_snapshot_async(self) -> tuple[int, list[int]]:
        return await self._control_async("kv_snapshot")

    def check_invariants(self) -> None:
        """Raise if any KV slot leaked or a lock count is off (O(KV capacity))."""
        try:
            self._control("check_invariants")
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None

    def stats(self) -> EngineStats:
        if self._stats is None:
            self._stats = self._control("stats")
        return self._stats


def _deliver(fork: RequestOutput, chunk: StreamChunk) -> None:
    """Hand a chunk to its consumer; a failing consumer must not stop the reading."""
    try:
        fork.sink(chunk)
    except Exception:
        log.exception("dropping output of request %s: its consumer failed", fork.rid)


def _kill(process: subprocess.Popen, sock: Any) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    sock.close()
