"""The engine core's process: a loop that never waits on HTTP, tokenizers or clients.

The front end (`engine.py`) owns the process. Two ZMQ PUSH/PULL pipes over IPC sockets connect
them: requests, aborts and controls in; `StepOutput`s and `ControlReply`s out. The loop drains its
inbox without blocking while there is work, blocks (bounded) when idle, and exits when told to or
when its parent dies. A flush waits until the engine is idle: admission pauses, running requests
finish, then the tree is emptied.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import traceback

import zmq

from radixpool.worker.config import EngineConfig
from radixpool.worker.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    CoreFailed,
    GenerateRequest,
    Shutdown,
    StepOutput,
)

log = logging.getLogger("radixpool.core")
IDLE_POLL_MS = 500


def run_core(config: EngineConfig, in_addr: str, out_addr: str, parent_pid: int) -> None:
    """Process entry point (spawned by the front end)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(out_addr)
    send = lambda obj: outbox.send(pickle.dumps(obj, protocol=5))  # noqa: E731
    try:
        from radixpool.worker.engine_core import EngineCore

        core = EngineCore(config)
    except Exception as exc:  # report why, so the front end can raise it
        send(CoreFailed(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    send(core.ready_message())
    _Loop(core, inbox, send, parent_pid).run()
    ctx.destroy(linger=100)


class _Loop:
    def __init__(self, core, inbox: zmq.Socket, send, parent_pid: int) -> None:
        self.core = core
        self.inbox = inbox
        self.send = send
        self.parent_pid = parent_pid
        self.pending_flushes: list[ControlRequest] = []
        self.running = True
        self.was_busy = False

    def run(self) -> None:
        while self.running:
            busy = self.core.has_work
            self._drain_inbox(block_ms=0 if busy else IDLE_POLL_MS)
            if not self.running:
                break
            if self.pending_flushes and not self.core.has_work:
                self._flush()
            out = self.core.step() if self.core.has_work else None
            if out is not None and (out.deltas or out.events):
                self.send(out)
            busy = self.core.has_work
            if self.was_busy and not busy:
                self.send(StepOutput(stats=self.core.stats()))  # the front end sees it go idle
                self._on_idle()
            self.was_busy = busy

    def _drain_inbox(self, block_ms: int) -> None:
        if block_ms and not self.inbox.poll(block_ms):
            if os.getppid() != self.parent_pid:
                self.running = False  # orphaned: the front end is gone
            return
        early: list = []
        while True:
            try:
                msg = pickle.loads(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            delta = self._handle(msg)
            if delta is not None:
                early.append(delta)
        if early:
            self.send(StepOutput(deltas=early, stats=self.core.stats()))

    def _handle(self, msg):
        if isinstance(msg, GenerateRequest):
            return self.core.add_request(msg)
        if isinstance(msg, AbortRequest):
            return self.core.abort(msg.rid)
        if isinstance(msg, ControlRequest):
            self._control(msg)
        elif isinstance(msg, Shutdown):
            self.running = False
        return None

    def _control(self, msg: ControlRequest) -> None:
        core = self.core
        try:
            if msg.kind == "flush_cache":
                self.pending_flushes.append(msg)  # answered once idle
                core.scheduler.admission_paused = True
                return
            if msg.kind == "kv_snapshot":
                payload = core.cache.snapshot()
            elif msg.kind == "probe":
                input_ids, namespace = msg.payload
                payload = core.probe(input_ids, namespace)
            elif msg.kind == "check_invariants":
                core.check_invariants()
                payload = None
            elif msg.kind == "stats":
                payload = core.stats()
            else:
                raise ValueError(f"unknown control {msg.kind!r}")
            self.send(ControlReply(msg.token, True, payload))
        except Exception as exc:
            self.send(ControlReply(msg.token, False, error=f"{type(exc).__name__}: {exc}"))

    def _flush(self) -> None:
        self.core.flush_cache()
        self.core.scheduler.admission_paused = False
        # The "cleared" event must reach the front end before the reply does.
        self.send(StepOutput(events=self.core.cache.drain_events(), stats=self.core.stats()))
        for msg in self.pending_flushes:
            self.send(ControlReply(msg.token, True))
        self.pending_flushes.clear()

    def _on_idle(self) -> None:
        if self.core.config.debug_invariants:
            try:
                self.core.check_invariants()
            except AssertionError as exc:
                log.error("engine invariant violated while idle: %s", exc)
                raise


def main(argv: list[str]) -> None:
    """`python -m radixpool.worker.core_process CONFIG_JSON IN_ADDR OUT_ADDR PARENT_PID`."""
    config = EngineConfig(**json.loads(argv[0]))
    run_core(config, argv[1], argv[2], int(argv[3]))


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("RADIXPOOL_LOG_LEVEL", "INFO").upper())
    main(sys.argv[1:])
