"""The circuit breaker of one worker: a pure state machine over the outcomes of real requests,
with the clock passed in (tests step it without sleeping).

    closed --`failures` consecutive failures--> open --`open_seconds` later--> half_open
    half_open --the probe succeeds--> closed        half_open --the probe fails--> open

- Closed lets everything through; a success resets the failure run.
- Open lets nothing through until `open_seconds` have passed since it opened. An outcome
  recorded meanwhile is a late one, of a request sent before it opened (a long stream that ends
  well): it changes nothing, so a worker failing every new request is not reopened to them by
  each older stream that ends.
- Half-open lets one request through at a time: the probe. Every outcome recorded while
  half-open resolves it, whatever its kind (success closes; a 5xx, a timeout, a connect error, a
  cut answer or a stream the worker ended with an error of its own reopens). A probe whose
  outcome is never recorded (its client left, its task was cancelled) holds the slot for at most
  `open_seconds`; then another probe goes, so the breaker never sticks half-open and a worker
  that answers again is never excluded for good.
- An error the worker says is its request's alone (`record_request_error`: the model's logits
  for that prompt were NaN) is neither: the state and the failure run stand, and a half-open
  probe's slot is freed for the next probe, which decides. One client repeating a poison prompt
  thus opens no breaker; a worker that fails every request so takes itself out (its `/health`).

The proxy's whole interface: `allows(now)` (may a new request go there), `dispatched(now)` (one
went), `record_success(now)`, `record_failure(kind, now)`, `record_request_error(now)`, and
`blocked_until(now)` (when it lets requests through again by itself: late binding offers its
held requests then); the health monitor calls `reset()` when the worker's checks bring it back
up.
"""

from __future__ import annotations

from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]
BREAKER_STATES: tuple[BreakerState, ...] = ("closed", "open", "half_open")
FailureKind = Literal["server_error", "timeout", "connect_error", "cut", "stream_error"]
FAILURE_KINDS: tuple[FailureKind, ...] = ("server_error", "timeout", "connect_error", "cut",
                                          "stream_error")


class CircuitBreaker:
    def __init__(self, failures: int, open_seconds: float) -> None:
        self.failures_needed = failures
        self.open_seconds = open_seconds
        self._state: BreakerState = "closed"
        self._failures = 0              # consecutive failures while closed
        self._half_open_at = 0.0   # open: when the cool-down ends
        self._probe_until: float | None = None  # half-open: the probe slot is taken until then
        self.failures_by_kind: dict[str, int] = {}

    def state(self, now: float) -> BreakerState:
        if self._state == "open" and now >= self._half_open_at:
            self._state, self._probe_until = "half_open", None
        return self._state

    def allows(self, now: float) -> bool:
        """Whether a new request may go to this worker now (does not take the probe slot)."""
        state = self.state(now)
        if state == "closed":
            return True
        if state == "open":
            return False
        return self._probe_until is None or now >= self._probe_until

    def blocked_until(self, now: float) -> float | None:
        """When a breaker that lets no new request through now will let one through again by
        itself: the cool-down's end, or a half-open probe's slot freed; None when it allows
        requests now."""
        state = self.state(now)
        if state == "open":
            return self._half_open_at
        if state == "half_open" and self._probe_until is not None and now < self._probe_until:
            return self._probe_until
        return None

    def dispatched(self, now: float) -> None:
        """A request was sent; while half-open it is the probe and takes the slot."""
        if self.state(now) == "half_open":
            self._probe_until = now + self.open_seconds

    def record_success(self, now: float) -> None:
        if self.state(now) == "open":
            return  # a late answer of a request sent before it opened: the cool-down stands
        self._state, self._failures, self._probe_until = "closed", 0, None

    def record_failure(self, kind: FailureKind, now: float) -> None:
        self.failures_by_kind[kind] = self.failures_by_kind.get(kind, 0) + 1
        state = self.state(now)
        if state == "open":
            return  # a late answer of a request sent before it opened: the cool-down stands
        self._failures += 1
        if state == "half_open" or self._failures >= self.failures_needed:
            self._state, self._probe_until = "open", None
            self._half_open_at = now + self.open_seconds

    def record_request_error(self, now: float) -> None:
        """An answer that failed its own request alone: no outcome for the worker."""
        if self.state(now) == "half_open":
            self._probe_until = None

    def reset(self) -> None:
        self._state, self._failures, self._probe_until = "closed", 0, None
