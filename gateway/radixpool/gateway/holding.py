"""The proxy's side of late binding: a held request waits here, on a future of its own, until the
wait queue places it (the rules are in wait_queue.py), or until the gateway's drain ends
(`close`: the proxy then answers it 503 `draining`, as it answers new arrivals during the
drain)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from radixpool.gateway.feedback import prefill_wait
from radixpool.gateway.metrics import GatewayMetrics
from radixpool.gateway.policies import Decision
from radixpool.gateway.route_key import RouteKey
from radixpool.gateway.wait_queue import Held, LateBinding
from radixpool.gateway.workers import Worker, WorkerSet

Release = Callable[[Worker, "tuple[int, float] | None", int], None]


class Holding:
    def __init__(self, binding: LateBinding, workers: WorkerSet, metrics: GatewayMetrics,
                 clock: Callable[[], float], release: Release) -> None:
        self.binding = binding
        self.workers = workers
        self.metrics = metrics
        self.clock = clock
        self.release = release  # the proxy's: a placed request given back
        # each held request's future, set when it is placed or given up, and its handler
        self._waiters: dict[Held, tuple[asyncio.Future, asyncio.Task]] = {}
        self.closed = False   # the gateway's drain ended: what was held then was given up
        # offers again when the soonest breaker cool-down ends (no other event says so)
        self._cool_down_timer: asyncio.TimerHandle | None = None
        self._cool_down_ends = 0.0
        workers.drain_hooks.append(self.offer)

    def __bool__(self) -> bool:
        """Whether any request is held."""
        return bool(self.binding.queue)

    def holds(self, worker: Worker, decision: Decision, key: RouteKey) -> bool:
        return self.binding.holds(worker, decision, key)

    async def wait(self, key: RouteKey) -> Held | None:
        """Hold the request until the wait queue places it (the worker already taken for it);
        None when no worker was eligible even at its deadline, or when `close` gave it up. A
        client that leaves while held withdraws it (counted as `left`)."""
        queue = self.binding.queue
        held = queue.hold(key, self.clock())
        deadline = held.since + queue.max_wait
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[held] = waiter, asyncio.current_task()
        self.metrics.holding += 1
        outcome = "placed"
        try:
            self.offer()
            if held.worker is None:
                # not wait_for: on 3.11 it swallows a cancellation that comes as the waiter is
                # set, and the request would go to its worker for a client already gone
                await asyncio.wait((waiter,), timeout=deadline - self.clock())
                if held.worker is None:  # the timer may fire a hair early: it is due now
                    self.offer(max(self.clock(), deadline))
            if held.worker is None:
                queue.withdraw(held)
                outcome = "rejected"
            elif self.clock() >= deadline:
                outcome = "overdue"
        except asyncio.CancelledError:
            if not queue.withdraw(held) and held.worker is not None:
                # placed as the client left: give it back
                self.release(held.worker, prefill_wait(held.decision, key), key.sequences)
                self.binding.policy.failed(held.decision, key)
            outcome = "left"
            raise
        finally:
            del self._waiters[held]
            self.metrics.holding -= 1
            self.metrics.held(outcome, self.clock() - held.since)
        return held if held.worker is not None else None

    def offer(self, now: float | None = None) -> None:
        """A worker's queue drained (or one joined, came back or left the rotation): offer the
        held requests again."""
        now = self.clock() if now is None else now
        for held in self.binding.release(now, lambda model: self.workers.eligible(now, model)):
            self._wake(held)
        if self.binding.queue:
            self._offer_when_a_breaker_lets_through()

    def _offer_when_a_breaker_lets_through(self) -> None:
        """Some requests stay held: offer them again the moment the soonest breaker that keeps
        a worker out lets requests through again (its cool-down ends, or a lost probe's slot
        frees), as no request or KV event need come then. One timer, for the soonest."""
        now = self.clock()
        ends = [end for worker in self.workers
                if (end := worker.breaker.blocked_until(now)) is not None]
        if not ends:
            return
        soonest = min(ends)
        if self._cool_down_timer is not None:
            if self._cool_down_ends <= soonest:
                return
            self._cool_down_timer.cancel()
        self._cool_down_ends = soonest
        self._cool_down_timer = asyncio.get_running_loop().call_later(
            soonest - now, self._cool_down_ended)

    def _cool_down_ended(self) -> None:
        self._cool_down_timer = None
        self.offer()

    def close(self) -> list[asyncio.Task]:
        """The gateway's drain ended: every request still held is given up (counted as
        `rejected`; its handler answers 503 `draining` rather than have its connection cut).
        Returns those handlers, for the gateway to let them answer before it closes."""
        self.closed = True
        given_up = [held for held in self._waiters if self.binding.queue.withdraw(held)]
        for held in given_up:
            self._wake(held)
        return [self._waiters[held][1] for held in given_up]

    def _wake(self, held: Held) -> None:
        waiter, _ = self._waiters.get(held, (None, None))
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
