"""What eviction costs the scheduler when the KV pool is full: decode steps that each need a few
slots, against a radix cache holding many leaves (the steady state of a long-running worker,
whose cache fills every slot requests do not hold).

    python bench/eviction_cost.py [--leaves 5000] [--steps 200] [--step-slots 64]

Each row plays the same steps: before a step, if fewer than `--step-slots` slots are free, the
cache evicts the difference (as `KVManager.allocate` does). Rows: eviction as it is (the last
leaf loses only the tail needed, each call frees at least 1/256 of the pool), without that
floor, and whole leaves with no floor (as before, and as SGLang evicts). Prints evictions per
step and host milliseconds per step; the pool only counts slots (`bench.simfleet.kv`), so this
is the tree's own cost.
"""

from __future__ import annotations

import argparse
import random
import time

from simfleet.kv import CountingPool, RangeRuns

from radixpool.worker.mem.eviction import make_eviction_policy
from radixpool.worker.mem.radix_cache import RadixCache


def full_cache(policy: str, leaves: int, whole: bool) -> RadixCache:
    """100 system prompts of 2,000 tokens, each with `leaves / 100` 200-token questions."""
    order = make_eviction_policy(policy)
    order.trims_leaves = not whole
    rng = random.Random(0)
    per_prompt = max(1, leaves // 100)
    capacity = 100 * 2000 + 100 * per_prompt * 200
    cache = RadixCache(CountingPool(capacity), 1, 16, order, RangeRuns())
    for s in range(100):
        system = [s * 100_000 + i for i in range(2000)]
        for _ in range(per_prompt):
            key = system + [rng.randrange(10**9) for _ in range(200)]
            present = cache.insert(key, range(len(key)))
            cache.pool.alloc(len(key) - present)
    cache.drain_events()
    return cache


def play(cache: RadixCache, steps: int, step_slots: int) -> tuple[int, float]:
    calls, start = 0, time.perf_counter()
    for _ in range(steps):
        free = cache.pool.available_size()
        if free < step_slots:
            cache.evict(step_slots - free)
            calls += 1
        cache.pool.alloc(step_slots)
    return calls, (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leaves", type=int, default=5000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-slots", type=int, default=64)
    p.add_argument("--policies", nargs="+", default=["lru", "probation"])
    args = p.parse_args()
    print(f"# {args.leaves} leaves, {args.steps} decode steps of {args.step_slots} slots each "
          "on a full pool")
    print(f"{'policy':<10} {'eviction':<22} {'evictions/step':>14} {'ms/step':>8}")
    for policy in args.policies:
        for name, whole, floor in (("tail, floor 1/256", False, True),
                                   ("tail, no floor", False, False),
                                   ("whole leaves (before)", True, False)):
            cache = full_cache(policy, args.leaves, whole)
            if not floor:
                cache.evict_floor = 0
            calls, per_step = play(cache, args.steps, args.step_slots)
            print(f"{policy:<10} {name:<22} {calls / args.steps:14.3f} {per_step * 1e3:8.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
