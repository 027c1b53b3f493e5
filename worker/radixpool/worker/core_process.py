"""The engine core's process: a loop that never waits on HTTP, tokenizers or clients.

The front end (`engine.py`) owns the process. One Unix socket pair connects them (`ipc.py`):
requests, aborts and controls in; `StepOutput`s and `ControlReply`s out. The loop drains its inbox
without blocking while there is work, waits (bounded) when idle, never blocks on a write, and
exits when told to or when its parent dies. A flush empties the tree only while the engine is
idle; with requests running or waiting it is refused at once (it never waits on them). While it
has work it says something at least every `HEARTBEAT_S` (its stats, when a step had nothing to
send, e.g. while a grammar compiles): the front end's watchdog reads a longer silence as a core
stuck in a step.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import sys
import time
import traceback

from radixpool.worker.config import EngineConfig
from radixpool.worker.ipc import Inbox, Outbox, PeerClosed
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
IDLE_WAIT_S = 0.5
HEARTBEAT_S = 1.0
SHUTDOWN_FLUSH_S = 5.0


def run_core(config: EngineConfig, fd: int, parent_pid: int) -> None:
    """Process entry point (spawned by the front end with its end of the socket pair)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sock = socket.socket(fileno=fd)
    outbox = Outbox(sock)
    stage = ""
    try:
        from radixpool.worker.engine_core import EngineCore

        core = EngineCore(config)
        warmup_s = 0.0
        if config.warmup:
            stage = "warm-up failed: "
            t0 = time.perf_counter()
            steps = core.warm_up()
            warmup_s = time.perf_counter() - t0
            log.info("warm-up: %d steps in %.2f s", steps, warmup_s)
    except Exception as exc:  # report why, so the front end can raise it
        # a setting the engine cannot run with (ValueError) is said in one line; anything else
        # is a fault, with its traceback
        detail = "" if isinstance(exc, ValueError) else f"\n{traceback.format_exc()}"
        outbox.send(CoreFailed(f"{stage}{type(exc).__name__}: {exc}{detail}"))
        outbox.drain(SHUTDOWN_FLUSH_S)
        return
    outbox.send(core.ready_message(warmup_s))
    loop = _Loop(core, Inbox(sock), outbox, parent_pid)
    try:
        loop.run()
        outbox.drain(SHUTDOWN_FLUSH_S)
    except PeerClosed:
        pass   # the front end is gone: nobody to answer
    sock.close()


class _Loop:
    def __init__(self, core, inbox: Inbox, outbox: Outbox, parent_pid: int) -> None:
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.running = True
        self.was_busy = False
        self.poller = select.poll()
        self.last_sent = time.monotonic()
        self.compiled = 0.0   # compile time the stats sent on going idle took in

    def _compiles_ended(self) -> bool:
        """Whether some compile ended since the last call (the stats sent next take it in)."""
        seen, self.compiled = self.compiled, self.core.grammars.compiler.compile_seconds_sum
        return seen != self.compiled

    def send(self, msg) -> None:
        self.outbox.send(msg)
        self.last_sent = time.monotonic()

    def run(self) -> None:
        while self.running:
            busy = self.core.has_work
            self.outbox.flush()
            self._drain_inbox(wait_s=0 if busy else IDLE_WAIT_S)
            if not self.running:
                break
            out = self.core.step() if self.core.has_work else None
            sent = out is not None and bool(out.deltas or out.events)
            if sent:
                self.send(out)   # its stats were taken after the step: idle ones if it went idle
            busy = self.core.has_work
            if self.was_busy and not busy:
                if self._compiles_ended() or not sent:
                    self.send(StepOutput(stats=self.core.stats()))  # the front end sees it idle
                self._on_idle()
            elif busy and time.monotonic() - self.last_sent >= HEARTBEAT_S:
                self.send(StepOutput(stats=self.core.stats()))   # alive, for the watchdog
            elif not busy and self._compiles_ended():
                # a compile its requests stopped waiting for ended while idle: its time shows
                # in the metrics now, not with the next request
                self.send(StepOutput(stats=self.core.stats()))
            self.was_busy = busy

    def _wait(self, wait_s: float) -> bool:
        """Until a message arrives (writing any backlog as the front end takes it)."""
        events = select.POLLIN | (select.POLLOUT if self.outbox.pending else 0)
        self.poller.register(self.inbox.sock, events)
        ready = self.poller.poll(wait_s * 1000)
        if ready and ready[0][1] & select.POLLOUT:
            self.outbox.flush()
        return bool(ready and ready[0][1] & (select.POLLIN | select.POLLHUP | select.POLLERR))

    def _drain_inbox(self, wait_s: float) -> None:
        if wait_s and not self._wait(wait_s):
            if os.getppid() != self.parent_pid:
                self.running = False  # orphaned: the front end is gone
            return
        try:
            messages = self.inbox.read()
        except PeerClosed:
            self.running = False
            return
        early: list = []
        for msg in messages:
            delta = self._handle(msg)
            if delta is not None:
                early.append(delta)
        # The `queued` events of the requests just taken in leave now, not with the next step's
        # output: a step later every other gateway could have sent the same new prompt to
        # another worker, cold (bench/results/routing_capacity_2cpu.txt 000p).
        events = self.core.drain_events()
        if early or events:
            self.send(StepOutput(deltas=early, events=events, stats=self.core.stats()))

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
                payload = self._flush()
            elif msg.kind == "kv_snapshot":
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

    def _flush(self) -> dict | None:
        """Empty the tree if idle (None); else the in-flight counts, and nothing changes."""
        busy = self.core.busy_counts()
        if busy is not None:
            return busy
        deltas = self.core.flush_cache()
        # The "cleared" event must reach the front end before the reply does.
        self.send(StepOutput(deltas=deltas, events=self.core.drain_events(),
                             stats=self.core.stats()))
        return None

    def _on_idle(self) -> None:
        if self.core.config.debug_invariants:
            try:
                self.core.check_invariants()
            except AssertionError as exc:
                log.error("engine invariant violated while idle: %s", exc)
                raise


def main(argv: list[str]) -> None:
    """`python -m radixpool.worker.core_process CONFIG_JSON SOCKET_FD PARENT_PID`."""
    config = EngineConfig(**json.loads(argv[0]))
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_core(config, int(argv[1]), int(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
