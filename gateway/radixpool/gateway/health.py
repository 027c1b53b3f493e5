"""Worker health over active checks: a pure state machine (the circuit breaker over real
traffic is `breaker.py`).

`HealthHysteresis`: `failures` consecutive failed checks take a healthy worker down; `successes`
consecutive good checks bring it back. One flaky probe moves nothing.
"""

from __future__ import annotations


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
