"""What the fleet's KV caches hold on the capacity-bound workload, and what that is worth.

    python bench/capacity_content.py [--workers 2 4] [--eviction-policies probation lru]

Plays `bench/routing.py`'s capacity-bound workload in virtual time (`bench.simfleet.virtual`),
as the partition reference and as `cache_aware` with late binding, and looks into the workers'
caches (the engine's own `RadixCache`) at every 8th prefill start. Columns:
  hit       the fleet hit rate the run got (as in `routing.py quality`)
  kv-sys    share of all KV slots holding system-prompt tokens (the rest: questions, free)
  held      the hit rate a request of a uniformly drawn group would get from what the fleet
            holds at that moment (each group's longest cached system prompt on any worker):
            the ceiling of any router, given those caches
  bound     `routing.py`'s ref:bound: every slot holding a distinct system prompt (- when
            all 64 fit)

`held` against `bound` is what the workers' eviction leaves on the table; `hit` against `held` is
the workload's own structure: each group is asked exactly 64 times in shuffled order, so the
groups asked most so far (those a reuse-aware cache keeps) have the fewest requests left.
"""

from __future__ import annotations

import argparse

from routing import (
    GROUPS,
    QUESTION_TOKENS,
    SYSTEM_TOKENS,
    capacity_bound,
    capacity_workload,
)
from simfleet.kv import SimKV
from simfleet.virtual import FleetModel, simulate

from radixpool.gateway.config import GatewayConfig

SAMPLE_EVERY = 8


class Inspector:
    """Wraps `SimKV.start` to look into every worker's cache at sampled prefill starts."""

    def __init__(self, systems: list[list[int]]) -> None:
        self.systems = systems
        self.workers: list[SimKV] = []
        self.starts = 0
        self.samples: list[tuple[float, float]] = []   # (kv-sys, held)

    def look(self) -> None:
        kv = self.workers
        per_group = [[w.cache.probe(s) for w in kv] for s in self.systems]
        slots = sum(w.pool.capacity for w in kv)
        cached = sum(sum(lengths) for lengths in per_group)
        best = sum(max(lengths) for lengths in per_group)
        self.samples.append((cached / slots, best / (GROUPS * (SYSTEM_TOKENS + QUESTION_TOKENS))))

    def install(self) -> None:
        inspector, start = self, SimKV.start

        def watched_start(kv: SimKV, token_ids: list[int], namespace: str | None):
            if kv not in inspector.workers:
                inspector.workers.append(kv)
            inspector.starts += 1
            if inspector.starts % SAMPLE_EVERY == 0:
                inspector.look()
            return start(kv, token_ids, namespace)

        SimKV.start = watched_start  # type: ignore[method-assign]
        self._restore = start

    def uninstall(self) -> None:
        SimKV.start = self._restore  # type: ignore[method-assign]

    def means(self) -> tuple[float, float]:
        tail = self.samples[len(self.samples) // 8:]   # after the caches first fill
        return (sum(s for s, _ in tail) / len(tail), sum(h for _, h in tail) / len(tail))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--eviction-policies", nargs="+", default=["probation", "lru"])
    p.add_argument("--requests", type=int, default=4096)
    p.add_argument("--kv-tokens", type=int, default=131072)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(f"# capacity-bound content, virtual time (seed {args.seed}): {args.requests} "
          f"requests, KV {args.kv_tokens} tokens/worker, sampled every {SAMPLE_EVERY}th prefill")
    print("  N evict     routing           hit  kv-sys   held  bound")
    for n in args.workers:
        requests = capacity_workload(n, args.requests, args.seed)
        systems = [r.tokens[:SYSTEM_TOKENS] for r in
                   sorted({r.group: r for r in requests}.values(), key=lambda r: r.group)]
        bound = capacity_bound(n, args.kv_tokens)
        for eviction in args.eviction_policies:
            model = FleetModel(n, args.kv_tokens, eviction)
            runs = [("ref:partition", dict(sticky=lambda r, n=n: r.group % n)),
                    ("cache_aware+late", dict(policy="cache_aware",
                                              gateway_config=GatewayConfig(late_binding=True)))]
            for name, routing in runs:
                inspector = Inspector(systems)
                inspector.install()
                try:
                    outcome = simulate(requests, model, **routing)
                finally:
                    inspector.uninstall()
                share, held = inspector.means()
                print(f"{n:>3} {eviction:<9} {name:<16} {outcome.hit_rate:5.3f} {share:6.1%} "
                      f"{held:6.3f} " + (f"{bound:6.3f}" if bound is not None else "     -"),
                      flush=True)


if __name__ == "__main__":
    main()
