"""Admission order: longest cached prefix first at thousands of queued requests, FCFS on request,
and the starvation guard."""

from __future__ import annotations

import random

import torch

from radixpool.worker.mem.kv_pool import KVPool
from radixpool.worker.mem.radix_cache import RadixCache
from radixpool.worker.request import Req
from radixpool.worker.sampling_params import SamplingParams
from radixpool.worker.scheduler.waiting_queue import Verdict, WaitingQueue

BLOCK = 16
PARAMS = SamplingParams(max_new_tokens=4)


def make_cache() -> RadixCache:
    pool = KVPool(200_000, 1, 1, 1, 1, torch.float32, "cpu")
    return RadixCache(pool, 1, BLOCK)


def cache_prefix(cache: RadixCache, ids: list[int], queue: WaitingQueue | None = None) -> None:
    match = cache.match_prefix(ids)
    slots = torch.cat([match.slots, cache.pool.alloc(len(ids) - match.length)])
    present = cache.insert(ids, slots)
    cache.pool.free(slots[match.length:present])
    for event in cache.drain_events():
        if queue is not None and event.type == "stored":
            queue.on_stored(event.blocks)


def order(queue: WaitingQueue, now: float = 0.0, admit: bool = False) -> list[Req]:
    seen: list[Req] = []

    def decide(req: Req) -> Verdict:
        seen.append(req)
        return Verdict.ADMIT if admit else Verdict.SKIP

    queue.offer(now, 1e9, decide)
    return seen


def true_blocks(cache: RadixCache, req: Req) -> int:
    return cache.probe(req.fill_ids) // BLOCK


def test_lpm_order_is_exact_with_thousands_waiting_and_follows_cache_changes():
    rng = random.Random(0)
    cache = make_cache()
    queue = WaitingQueue(cache, "lpm")
    stems = [[rng.randrange(5, 1000) for _ in range(256)] for _ in range(40)]
    reqs = []
    for i in range(3000):
        stem = rng.choice(stems)
        ids = stem[:rng.randrange(0, 256)] + [rng.randrange(5, 1000) for _ in range(20)]
        req = Req(f"r{i}", ids, PARAMS, 0, seq=i + 1)
        queue.push(req)
        reqs.append(req)

    def assert_lpm(seen: list[Req]) -> None:
        assert len(seen) == len(queue)
        keys = [(-true_blocks(cache, r), r.seq) for r in seen]
        assert keys == sorted(keys), "not longest-prefix-first (FCFS among equals)"

    # Cache grows after the requests arrived: the order follows (incrementally, via events).
    for stem in stems[:10]:
        cache_prefix(cache, stem[:rng.randrange(32, 256)], queue)
    seen = order(queue)
    assert_lpm(seen)
    assert true_blocks(cache, seen[0]) >= 2

    # The cache loses some of it: stale priorities are corrected before anything is offered.
    cache.evict(cache.total_size // 2)
    cache.drain_events()
    assert_lpm(order(queue))

    # Admitting takes requests out in that order.
    admitted = order(queue, admit=True)
    assert len(admitted) == 3000 and len(queue) == 0


def test_fcfs_ignores_the_cache():
    cache = make_cache()
    queue = WaitingQueue(cache, "fcfs")
    cached = list(range(100, 164))
    cache_prefix(cache, cached)
    queue.push(Req("cold", [1, 2, 3], PARAMS, 0, seq=1))
    queue.push(Req("warm", [*cached, 5], PARAMS, 0, seq=2))
    assert [r.rid for r in order(queue)] == ["cold", "warm"]


def test_starving_request_goes_first_even_without_cache_hits():
    cache = make_cache()
    queue = WaitingQueue(cache, "lpm")
    cached = list(range(100, 164))
    cache_prefix(cache, cached)
    queue.push(Req("old-cold", [1, 2, 3], PARAMS, 0, arrival_time=0.0, seq=1))
    queue.push(Req("new-warm", [*cached, 5], PARAMS, 0, arrival_time=95.0, seq=2))
    assert [r.rid for r in order(queue, now=100.0)] == ["new-warm", "old-cold"]

    seen: list[str] = []
    queue.offer(100.0, 30.0, lambda r: seen.append(r.rid) or Verdict.STOP)
    assert seen == ["old-cold"], "a request past the wait bound is offered before any other"


def test_removed_requests_are_never_offered():
    cache = make_cache()
    queue = WaitingQueue(cache, "lpm")
    reqs = [Req(f"r{i}", [i + 10] * 40, PARAMS, 0, seq=i + 1) for i in range(5)]
    for r in reqs:
        queue.push(r)
    queue.remove(reqs[2])
    assert [r.rid for r in order(queue)] == ["r0", "r1", "r3", "r4"]


def test_a_lone_request_is_ranked_once_another_joins_it():
    cache = make_cache()
    queue = WaitingQueue(cache, "lpm")
    cached = list(range(100, 164))
    lone = Req("lone-warm", [*cached, 7], PARAMS, 0, seq=1)
    queue.push(lone)
    cache_prefix(cache, cached, queue)   # its prefix lands while it waits alone
    queue.push(Req("cold", [1, 2, 3], PARAMS, 0, seq=2))
    queue.push(Req("warmer", [*cached, *range(300, 340)], PARAMS, 0, seq=3))
    cache_prefix(cache, [*cached, *range(300, 340)], queue)
    assert [r.rid for r in order(queue)] == ["warmer", "lone-warm", "cold"]
    assert lone.match_blocks == len(cached) // BLOCK

    # Alone again after the others leave: offered, and removable, as before.
    for rid in ("warmer", "cold"):
        queue.remove(queue.get(rid))
    assert [r.rid for r in order(queue, admit=True)] == ["lone-warm"]
    assert len(queue) == 0


def test_requests_behind_a_shared_uncached_prefix_cost_nothing_per_step(monkeypatch):
    """With thousands waiting on a prefix another request is computing (chunk by chunk), a step
    looks at no more of them than with a few waiting: work per step does not grow with the
    queue (it was a scan of every waiting request per step, 27 ms at 8,000)."""
    from kv_driver import make_scheduler

    import radixpool.worker.scheduler.waiting_queue as wq

    def touched_per_step(waiting: int) -> list[int]:
        sched, model = make_scheduler(1, 40_000, chunk=64, max_prefill=64, max_running=8)
        prefix = list(range(100, 612))          # 512 tokens: 8 chunks
        for i in range(waiting):
            sched.add(Req(f"r{i}", [*prefix, 1000 + i, 7, 8], PARAMS, 0, arrival_time=1e12))
        touched = [0]
        exact = wq.WaitingQueue._exact_blocks

        def counting(self, req):
            touched[0] += 1
            return exact(self, req)

        monkeypatch.setattr(wq.WaitingQueue, "_exact_blocks", counting)
        per_step = []
        for _ in range(8):                       # the shared prefix is being computed
            touched[0] = 0
            batch = sched.next_batch()
            sched.process(batch, model.run(batch))
            for event in sched.cache.drain_events():
                if event.type == "stored":
                    sched.waiting.on_stored(event.blocks)
            per_step.append(touched[0])
        monkeypatch.undo()
        return per_step

    few, many = touched_per_step(20), touched_per_step(2000)
    assert many == few and max(many) <= 8, (few, many)


def test_requests_held_behind_a_shared_prefix_all_run_and_hit_it():
    from kv_driver import Outcome, expected_output, make_scheduler, run_all

    sched, model = make_scheduler(1, 40_000, chunk=64, max_prefill=64, max_running=8)
    prefix = list(range(100, 612))
    prompts = {f"r{i}": [*prefix, 1000 + i, 7, 8] for i in range(300)}
    for rid, ids in prompts.items():
        sched.add(Req(rid, ids, SamplingParams(max_new_tokens=3), 0, arrival_time=1e12))
    outcomes: dict[str, Outcome] = {}
    cached: dict[str, int] = {}
    original = sched.process

    def process(batch, tokens):
        deltas = original(batch, tokens)
        for event in sched.cache.drain_events():
            if event.type == "stored":
                sched.waiting.on_stored(event.blocks)
        cached.update((d.rid, d.cached_tokens) for d in deltas if d.finished)
        return deltas

    sched.process = process
    run_all(sched, model, outcomes)
    for rid, ids in prompts.items():
        assert (outcomes[rid].tokens, outcomes[rid].finish_reason) == expected_output(ids, 3)
    assert sorted(cached.values())[1:] == [512] * 299, "the shared prefix was computed again"
