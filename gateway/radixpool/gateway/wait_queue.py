"""Late binding: a request whose best worker is saturated waits in the gateway, not in a worker.

With early binding a request is committed to a worker on arrival and sits in that worker's FIFO
prefill queue, even when another worker goes idle a moment later. Here, when the worker the
policy picks already has more than `hold_queued_tokens` of prefill queued (`Worker.queued`: the
uncached tokens of the requests sent there whose prefill has not ended), the request is held; so
are all later arrivals while anything is held (first come, first placed). Whenever a worker's
queue drains (a KV event stores a prompt, a request ends or fails, a worker joins or its checks
or discovery bring it back, its breaker's cool-down ends, or its KV events stop or start being
followed), and whenever a worker leaves the rotation (the cache owner a request waited for may
be gone), the held requests are offered again, oldest first, each to the worker where it would
get its first token soonest counting the cache (`Policy.place`: queued prefill there + its
uncached part + the reused prefixes it would push out; for `cache_aware`, among the prefix's
owners when it has some, or an idle worker by the spill rule); it is sent when that worker is
no longer saturated, else it keeps waiting, without blocking younger requests bound elsewhere.

Bounds. A request held `hold_max_seconds` is sent anyway to its soonest worker, saturated or not:
the workers are up and merely busy, so a 503 would throw away work early binding would have done
(the fallback is never worse than no queue). While `hold_max_requests` are held, new arrivals
bypass the queue (early binding). Only when no eligible worker is left at the deadline is the
request answered 503, or when the gateway stops: held requests are still placed during its
drain, and those left when it ends get 503 `draining`. A held request whose client leaves is
withdrawn. Nothing is bound to a worker while held, so a worker that dies takes no held request
with it.

`WaitQueue` is the pure core (no clock, no I/O): the proxy and the virtual fleet
(`bench/simfleet/virtual.py`) drive the same `LateBinding` around it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixpool.gateway.feedback import prefill_wait
from radixpool.gateway.policies import Decision, Policy
from radixpool.gateway.route_key import RouteKey
from radixpool.gateway.workers import Worker, candidates


@dataclass(eq=False, slots=True)
class Held:
    key: RouteKey
    since: float
    worker: Worker | None = None       # set once, when placed
    decision: Decision | None = None


Place = Callable[[Held, bool], bool]   # (held, overdue) -> placed


class WaitQueue:
    """Held requests in arrival order. Each leaves exactly once: placed by `release`, or
    withdrawn (its client left)."""

    def __init__(self, max_held: int, max_wait: float) -> None:
        self.max_held = max_held
        self.max_wait = max_wait
        self._held: dict[Held, None] = {}   # insertion-ordered set: oldest first

    def __len__(self) -> int:
        return len(self._held)

    def __bool__(self) -> bool:
        return bool(self._held)

    def admits(self) -> bool:
        return len(self._held) < self.max_held

    def hold(self, key: RouteKey, now: float) -> Held:
        held = Held(key, now)
        self._held[held] = None
        return held

    def withdraw(self, held: Held) -> bool:
        """The client left: False when it was already placed (the caller then owns a worker)."""
        if held not in self._held:
            return False
        del self._held[held]
        return True

    def release(self, now: float, place: Place) -> list[Held]:
        """Offer every held request, oldest first, to `place`; those placed leave the queue."""
        placed = []
        for held in list(self._held):
            if place(held, now - held.since >= self.max_wait):
                del self._held[held]
                placed.append(held)
        return placed

    def next_deadline(self) -> float | None:
        oldest = next(iter(self._held), None)
        return None if oldest is None else oldest.since + self.max_wait


class LateBinding:
    """The wait queue and the placement of its requests on `Worker`s: what the proxy and the
    virtual fleet share. Placing takes the worker (in-flight count, queued prefill, a half-open
    breaker's probe) at once, so the next held request sees it."""

    def __init__(self, policy: Policy, threshold: float, max_held: int, max_wait: float) -> None:
        self.policy = policy
        self.threshold = threshold
        self.queue = WaitQueue(max_held, max_wait)

    def holds(self, worker: Worker, decision: Decision, key: RouteKey) -> bool:
        """Whether a request just routed to `worker` waits here instead: when that worker has
        more than `threshold` tokens of prefill queued, or others are held already. Not a
        request that hits the worker's cache, with at most `threshold` tokens left to compute,
        on a worker that runs cached prompts first: the queued prefill there is colder and
        does not delay it past the worker's next step, while waiting here would (and leave its
        prefix unlocked for evictions meanwhile). When nothing is held this is a couple of
        comparisons."""
        if worker.cached_first and decision.predicted_blocks:
            wait = prefill_wait(decision, key)
            if wait is not None and wait[1] <= self.threshold:
                return False
        if self.queue:
            return self.queue.admits()
        return worker.queued(key.tokens) > self.threshold and self.queue.admits()

    def release(self, now: float, eligible: Callable[[str | None], Sequence[Worker]]
                ) -> list[Held]:
        def place(held: Held, overdue: bool) -> bool:
            ready = eligible(held.key.model)
            if not ready:
                return False
            key = held.key
            decision = self.policy.place(candidates(ready, key), key, self.threshold, overdue)
            if decision is None:
                return False
            worker = next(w for w in ready if w.url == decision.worker)
            worker.take(prefill_wait(decision, key), key.sequences)
            worker.breaker.dispatched(now)   # a half-open worker's probe: the next held must wait
            held.worker, held.decision = worker, decision
            return True

        return self.queue.release(now, place) if self.queue else []
