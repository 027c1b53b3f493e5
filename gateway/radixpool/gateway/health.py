"""Worker health over active checks: a pure state machine (the circuit breaker over real
traffic is `breaker.py`).

`HealthHysteresis`: `failures` consecutive failed checks take a healthy worker down; `successes`
consecutive good checks bring it back. One flaky probe moves nothing once the worker has passed
a check (`proven`). Before that, each check decides at once: a listed worker is taken as healthy
until its first check (a request need not wait for the first round), one that does not answer is
down from that first check (not after `failures` rounds), and a worker still starting is up from
its first good check. The gateway's readiness counts proven workers only.
"""

from __future__ import annotations


class HealthHysteresis:
    def __init__(self, failures: int, successes: int, healthy: bool = True) -> None:
        self.failures_needed = failures
        self.successes_needed = successes
        self.healthy = healthy
        self.proven = False   # a check has passed since it was listed
        self._run = 0  # consecutive results that disagree with the current state

    def record(self, ok: bool) -> bool:
        """Feed one check result; returns True when the healthy flag flipped."""
        if not self.proven:
            self.proven = ok
            flipped, self.healthy, self._run = ok != self.healthy, ok, 0
            return flipped
        if ok == self.healthy:
            self._run = 0
            return False
        self._run += 1
        needed = self.successes_needed if ok else self.failures_needed
        if self._run >= needed:
            self.healthy, self._run = ok, 0
            return True
        return False
