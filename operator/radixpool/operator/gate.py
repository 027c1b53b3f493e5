"""Per-pool turns and retry backoff, shared by the kopf handlers of one operator process.

- One pass at a time per pool: the timer and the create/update handlers run in different
  threads, and two passes over one pool would race on its objects and its status. A spec change
  waits for its turn; a timer tick finding the pool busy skips (the pass under way covers it).
- After a pass the API stopped (`ApiFailure`), timer ticks wait: the next attempt comes after
  `base`, then twice that, up to `cap` seconds; the status says when. A spec change tries at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class PoolGate:
    def __init__(self, base: float = 15.0, cap: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        self.base, self.cap, self.clock = base, cap, clock
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._failures: dict[str, int] = {}
        self._not_before: dict[str, float] = {}

    @contextmanager
    def turn(self, pool: str, *, wait: bool) -> Iterator[bool]:
        """Yields whether this caller holds the pool's turn (always, when `wait`)."""
        with self._guard:
            lock = self._locks.setdefault(pool, threading.Lock())
        held = lock.acquire(blocking=wait)
        try:
            yield held
        finally:
            if held:
                lock.release()

    def due(self, pool: str) -> bool:
        """Whether a timer tick may try this pool now."""
        with self._guard:
            return self.clock() >= self._not_before.get(pool, 0.0)

    def next_delay(self, pool: str) -> float:
        """How long the pool waits if the attempt about to run fails."""
        with self._guard:
            return min(self.base * 2 ** self._failures.get(pool, 0), self.cap)

    def failed(self, pool: str) -> float:
        delay = self.next_delay(pool)
        with self._guard:
            self._failures[pool] = self._failures.get(pool, 0) + 1
            self._not_before[pool] = self.clock() + delay
        return delay

    def succeeded(self, pool: str) -> None:
        with self._guard:
            self._failures.pop(pool, None)
            self._not_before.pop(pool, None)

    def failures(self, pool: str) -> int:
        with self._guard:
            return self._failures.get(pool, 0)
