"""Worker health: hysteresis over active checks, and a circuit breaker over real traffic.

Both are pure state machines with the clock passed in, so tests step them without sleeping.

- `HealthHysteresis`: `failures` consecutive failed checks take a healthy worker down;
  `successes` consecutive good checks bring it back. One flaky probe moves nothing.
- `CircuitBreaker`: `failures` consecutive failed requests (connect errors, 5xx) open it; while
  open the worker gets no traffic; after `open_seconds` it is half-open and lets exactly one
  request through as a probe; that probe's success closes it, its failure reopens it.
"""

from __future__ import annotations

from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]


class HealthHysteresis:
    def __init__(self, failures: int, successes: int, healthy: bool = True) -> None:
        self.failures_needed = failures
        self.successes_needed = successes
        self.healthy = healthy
        self._run = 0  # consecutive results that disagree with the current state

    def record(self, ok: bool) -> bool:
        """Feed one check result; returns True when the healthy flag flipped."""
        if ok == self.healthy:
            self._run = 0
            return False
        self._run += 1
        needed = self.successes_needed if ok else self.failures_needed
        if self._run >= needed:
            self.healthy, self._run = ok, 0
            return True
        return False


class CircuitBreaker:
    def __init__(self, failures: int, open_seconds: float) -> None:
        self.failures_needed = failures
        self.open_seconds = open_seconds
        self.state: BreakerState = "closed"
        self._failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False

    def allows(self, now: float) -> bool:
        """Whether a new request may go to this worker now (does not take the probe slot)."""
        if self.state == "closed":
            return True
        if self.state == "open" and now - self._opened_at >= self.open_seconds:
            self.state = "half_open"
        return self.state == "half_open" and not self._probe_in_flight

    def on_dispatch(self) -> None:
        if self.state == "half_open":
            self._probe_in_flight = True

    def record(self, ok: bool, now: float) -> None:
        if ok:
            self.state, self._failures, self._probe_in_flight = "closed", 0, False
            return
        self._failures += 1
        if self.state == "half_open" or self._failures >= self.failures_needed:
            self.state, self._opened_at, self._probe_in_flight = "open", now, False

    def reset(self) -> None:
        self.state, self._failures, self._probe_in_flight = "closed", 0, False
