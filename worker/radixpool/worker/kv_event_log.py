"""The front end's bounded log of radix-cache events, for the worker's `/kv_events` stream.

Events arrive from the core process on the engine's receiver thread (or, in a server, on its
event loop); HTTP handlers read them on the event loop. A reader that fell behind the ring's start
gets `None` from `events_since` and must resync from a snapshot (`Engine.kv_snapshot`).

The stream also carries the worker's load (how many requests it holds), so that several gateways,
each of which counts only the requests it sent itself, see the same load: `touch` says the load
changed, and a reader that said which load it last saw is answered once it differs,
`LOAD_LINGER_S` later, so a burst of arrivals is one answer and a reader polls at most about
1 / `LOAD_LINGER_S` times a second for load alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections import deque
from collections.abc import Callable

from radixpool.protocol.kv_blocks import KVEvent

DEFAULT_CAPACITY = 65536
# A queued or stored event names every whole block of its prompt: 65,536 events of 8k-token
# prompts held ~1.8 GB of hashes. The ring is bounded by blocks too; 2M are ~115 MB, seconds of
# history at any rate a gateway keeps up with (one that falls behind resyncs from a snapshot).
DEFAULT_MAX_BLOCKS = 1 << 21
LOAD_LINGER_S = 0.01


class KVEventLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY,
                 max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self._events: deque[KVEvent] = deque()
        self.capacity = capacity
        self.max_blocks = max_blocks
        self._blocks = 0   # block hashes held by the events in the ring
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.last_seq = 0

    def append(self, events: list[KVEvent]) -> None:
        if not events:
            return
        with self._lock:
            ring = self._events
            ring.extend(events)
            self._blocks += sum(len(e.blocks) for e in events)
            while len(ring) > self.capacity or (self._blocks > self.max_blocks and len(ring) > 1):
                self._blocks -= len(ring.popleft().blocks)
            self.last_seq = events[-1].seq
            waiters, self._waiters = self._waiters, []
        _wake_all(waiters)

    def events_since(self, seq: int) -> list[KVEvent] | None:
        """Events with `seq` greater than the argument, or None if some were already dropped."""
        with self._lock:
            if seq >= self.last_seq:
                return []
            first = self._events[0].seq if self._events else self.last_seq + 1
            if seq < first - 1:
                return None
            # the newest last_seq - seq events, walked from the end: O(answer), not O(ring)
            newest = list(itertools.islice(reversed(self._events), self.last_seq - seq))
            return newest[::-1]

    def touch(self) -> None:
        """The load changed: wake the readers waiting, those watching the load answer."""
        with self._lock:
            waiters, self._waiters = self._waiters, []
        _wake_all(waiters)

    async def wait(self, seq: int, timeout: float, load: Callable[[], int] | None = None,
                   seen: int | None = None) -> None:
        """Return once an event after `seq` exists, or after `timeout` seconds; with `seen`
        (the load the reader last saw), also once `load()` differs from it, `LOAD_LINGER_S`
        later."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.last_seq <= seq:
            if seen is not None and load is not None and load() != seen:
                await asyncio.sleep(LOAD_LINGER_S)
                return
            left = deadline - loop.time()
            if left <= 0:
                return
            await self._wait_once(seq, left)

    async def _wait_once(self, seq: int, timeout: float) -> None:
        """Return at the next append or `touch`, or after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if self.last_seq > seq:
                return
            self._waiters.append((loop, fut))
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(fut, timeout)
        finally:
            with self._lock:  # a waiter that timed out or was cancelled must not linger
                self._waiters = [w for w in self._waiters if w[1] is not fut]


def _wake_all(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]) -> None:
    for loop, fut in waiters:
        loop.call_soon_threadsafe(_wake, fut)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
