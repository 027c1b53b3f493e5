"""The pipe to the engine core (framing, a core that never blocks on a slow front end), and an
engine whose output is read on an event loop (`bind_loop`), including its core dying under it."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import threading
import time

import pytest

from radixpool.worker import Engine
from radixpool.worker.ipc import Inbox, Outbox, PeerClosed, frame, socket_pair


def test_messages_survive_any_split_of_the_byte_stream():
    front, core = socket_pair()
    messages = [{"i": i, "ids": list(range(i * 37 % 500))} for i in range(200)]
    stream = b"".join(frame(m) for m in messages)
    rng = random.Random(0)
    inbox, got, pos = Inbox(front), [], 0
    while pos < len(stream):   # arbitrary cuts, mid-header and mid-payload
        step = rng.randint(1, 700)
        core.sendall(stream[pos:pos + step])
        pos += step
        got.extend(inbox.read())
    assert got == messages
    assert inbox.read() == []   # nothing more, and the peer is still there


def test_what_was_sent_before_the_peer_closed_is_still_delivered():
    front, core = socket_pair()
    Outbox(core).send("last words")
    core.close()
    inbox = Inbox(front)
    assert inbox.wait(1.0)
    assert inbox.read() == ["last words"]
    with pytest.raises(PeerClosed):
        inbox.read()


def test_the_core_never_blocks_on_a_front_end_that_does_not_read():
    front, core = socket_pair()
    outbox = Outbox(core)
    payload = [bytes([i % 256]) * 100_000 for i in range(300)]   # ~30 MB, far over the buffers
    writer = threading.Thread(target=lambda: [outbox.send(item) for item in payload],
                              daemon=True)
    writer.start()
    writer.join(30)
    assert not writer.is_alive(), "a write blocked on a reader that does not read"
    assert outbox.pending, "the socket cannot have taken it all"
    inbox, got = Inbox(front), []
    while len(got) < len(payload):
        got.extend(inbox.read())
        outbox.flush()
    assert got == payload and not outbox.pending


def test_a_front_end_that_went_away_is_reported():
    front, core = socket_pair()
    front.close()
    with pytest.raises(PeerClosed):
        Outbox(core).send("anyone?")


@pytest.fixture
def engine(tiny_model):
    eng = Engine(str(tiny_model), device="cpu", kv_cache_tokens=2048)
    yield eng
    eng.shutdown()


GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def test_a_loop_bound_engine_gives_the_same_tokens_and_refuses_to_block_its_loop(engine):
    expected = engine.generate("the same prompt", GREEDY)["output_ids"]

    async def main() -> None:
        engine.bind_loop()
        with pytest.raises(RuntimeError, match="already bound"):
            engine.bind_loop()
        out = await engine.generate_async("the same prompt", GREEDY)
        assert out["output_ids"] == expected
        streamed = [t async for chunk in engine.stream("the same prompt", GREEDY)
                    for t in chunk.token_ids]
        assert streamed == expected
        for blocking in (lambda: engine.generate("x", GREEDY), lambda: engine.probe([1, 2]),
                         engine.flush_cache):
            with pytest.raises(RuntimeError, match="async form"):
                blocking()
        # another thread may still block: the loop delivers its output
        other = await asyncio.to_thread(engine.generate, "the same prompt", GREEDY)
        assert other["output_ids"] == expected
        assert await engine.probe_async(engine.tokenizer.encode("the same prompt")) > 0

    asyncio.run(main())


async def stream_into(engine: Engine, fault) -> None:
    """Stream a long answer, run `fault()` once its first tokens are in, and see the stream
    end with the core's death."""
    seen, faulted = 0, False
    with pytest.raises(RuntimeError, match="died"):
        async for chunk in engine.stream("long", {"max_new_tokens": 1500, "ignore_eos": True}):
            seen += len(chunk.token_ids)
            if seen >= 2 and not faulted:
                faulted = True
                fault()


def test_a_core_that_dies_ends_streams_with_an_error_and_refuses_new_work(engine):
    async def main() -> None:
        engine.bind_loop()
        await stream_into(engine, engine._process.kill)   # the core crashes mid-stream
        with pytest.raises(RuntimeError, match="died"):
            await engine.generate_async("after", GREEDY)
        assert not engine.alive

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_core_stuck_in_a_step_is_killed_by_the_watchdog(tiny_model):
    # A core stuck in a step (a hung GPU, a deadlock; here SIGSTOP) left every request hanging
    # behind it while the worker's health stayed 200; the gateway gave up only after 300 s.
    engine = Engine(str(tiny_model), device="cpu", kv_cache_tokens=2048, watchdog_timeout_s=2)
    try:
        async def main() -> float:
            engine.bind_loop()
            stopped: list[float] = []
            await stream_into(engine, lambda: (os.kill(engine._process.pid, signal.SIGSTOP),
                                               stopped.append(time.monotonic())))
            return time.monotonic() - stopped[0]

        waited = asyncio.run(asyncio.wait_for(main(), 60))
        assert 2 <= waited < 10, waited
        assert not engine.alive and "--watchdog-timeout 2" in engine.stall
    finally:
        engine.shutdown()


def test_a_busy_core_that_sends_no_tokens_is_not_taken_for_stuck(tiny_model):
    # Waiting seconds for a grammar to compile, the core has no tokens to send: it says it is
    # alive every second, so a 2 s watchdog leaves it be.
    import json

    slow = json.dumps({"type": "object",
                       "properties": {f"p{i}": {"type": "integer"} for i in range(350)}})
    engine = Engine(str(tiny_model), device="cpu", kv_cache_tokens=2048, watchdog_timeout_s=2)
    try:
        started = time.monotonic()
        out = engine.generate("json please", {"max_new_tokens": 4, "json_schema": slow})
        assert time.monotonic() - started > 2   # longer than the watchdog waits
        assert out["meta_info"]["finish_reason"] != "abort", out
        assert engine.alive and engine.stall is None
    finally:
        engine.shutdown()


def test_a_compile_that_ends_after_its_request_gave_up_shows_in_the_stats_while_idle(
        tiny_model):
    # It showed only once the next request came: radixpool_grammar_compile_seconds missed the
    # slowest compiles, those that outlive --grammar-compile-timeout, on a quiet worker.
    import json

    slow = json.dumps({"type": "object",
                       "properties": {f"p{i}": {"type": "integer"} for i in range(150)}})
    engine = Engine(str(tiny_model), device="cpu", kv_cache_tokens=2048,
                    grammar_compile_timeout_s=0.2)
    try:
        with pytest.raises(ValueError, match=r"did not compile within 0\.2 s"):
            engine.generate("json please", {"max_new_tokens": 4, "json_schema": slow})
        assert engine.stats().grammar_compile_buckets[-1] == 0
        deadline = time.monotonic() + 60
        while engine.stats().grammar_compile_buckets[-1] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.stats().grammar_compile_buckets[-1] == 1
        assert engine.stats().grammar_compile_seconds_sum > 0.2
    finally:
        engine.shutdown()


def test_a_message_larger_than_the_pipe_reaches_the_core_whole_under_uvloop(engine):
    # uvloop (libuv) makes a descriptor it watches non-blocking, so `sendall` stopped at the first
    # full socket buffer and left part of a message in the pipe: the core read every later message
    # out of frame, the worker answered 500 "the engine core process died" to everything after,
    # and its core ran on with /health still 200. The worker's server runs on uvloop.
    uvloop = pytest.importorskip("uvloop")
    expected = engine.generate("the same prompt", GREEDY)["output_ids"]

    buffers = sum(engine._sock.getsockopt(socket.SOL_SOCKET, opt)
                  for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF))

    async def main() -> None:
        engine.bind_loop()
        assert await engine.probe_async([7] * buffers) == 0   # ~2 bytes an id once pickled
        out = await engine.generate_async("the same prompt", GREEDY)
        assert out["output_ids"] == expected

    uvloop.run(asyncio.wait_for(main(), 60))


def test_the_event_loop_runs_on_while_the_core_is_slow_to_take_a_large_message(engine):
    # The core reads its pipe between steps. A message larger than the pipe's free space (a long
    # prompt: 0.4-0.55 MB for 128k tokens, over the 416 KiB that Linux's default wmem_max allows a
    # socket) held the front end's event loop until the core had read it, so every other stream
    # stood still through the core's step. A stopped core makes that step as long as we like.
    uvloop = pytest.importorskip("uvloop")
    expected = engine.generate("the same prompt", GREEDY)["output_ids"]
    engine._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    ids = [7] * (1 << 20)   # ~2 MB pickled, many times the buffer
    stopped = threading.Event()
    resumed = threading.Timer(5.0, lambda: os.kill(engine._process.pid, signal.SIGCONT))

    async def main() -> float:
        engine.bind_loop()
        os.kill(engine._process.pid, signal.SIGSTOP)
        stopped.set()
        resumed.start()   # unsticks a loop that waits on the core, so the test fails, not hangs
        probe = asyncio.ensure_future(engine.probe_async(ids))
        started = time.monotonic()
        await asyncio.sleep(0.2)
        slept = time.monotonic() - started
        # a blocking call from another thread queues behind what the loop still has to write
        other = asyncio.ensure_future(asyncio.to_thread(engine.generate, "the same prompt",
                                                        GREEDY))
        await asyncio.sleep(0.1)
        os.kill(engine._process.pid, signal.SIGCONT)
        assert await probe == 0
        assert (await other)["output_ids"] == expected
        out = await engine.generate_async("the same prompt", GREEDY)   # later messages in step
        assert out["output_ids"] == expected
        return slept

    try:
        slept = uvloop.run(asyncio.wait_for(main(), 60))
    finally:
        resumed.cancel()
        if stopped.is_set():
            os.kill(engine._process.pid, signal.SIGCONT)
    assert slept < 2.0, f"the event loop stood still {slept:.1f} s waiting on the core"


def test_the_engine_waits_for_its_core_as_long_as_startup_timeout_says(tiny_model):
    """The wait for the core to load is the caller's to set (a pod passes its startup budget):
    it was fixed at 900 s, so a model that took longer to load was restarted forever."""
    with pytest.raises(RuntimeError, match=r"not ready after 0.001 s \(--startup-timeout\)"):
        Engine(str(tiny_model), device="cpu", kv_cache_tokens=2048, startup_timeout_s=0.001)
    with pytest.raises(ValueError, match="startup_timeout_s"):
        Engine(str(tiny_model), device="cpu", startup_timeout_s=0)
