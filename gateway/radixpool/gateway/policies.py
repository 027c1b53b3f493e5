"""Routing policies: given the eligible workers with their in-flight load and a request's key,
pick one. Pure: no I/O, no clock; the proxy owns the loop around them.

`cache_aware` (default), per request:
1. Match the prompt's block hashes against every worker's tree (`PrefixIndex`). The part that
   counts is the match *beyond a base*: the prefix every eligible worker already holds, or a hot
   prefix every worker can cheaply hold — one carrying at least `hot_prefix_factor` workers' share
   of the recent traffic for its model (a common system prompt). Without that, whoever first
   cached the system prompt would "match" every new session and the rest of the fleet would sit
   idle.
2. If the best effective match covers more than `cache_threshold` of the prompt beyond the base,
   the owner of that match is the candidate (several owners → the least loaded of them).
3. Imbalance: if that owner's in-flight load exceeds the least-loaded worker's by more than
   `balance_abs_threshold` AND by a factor above `balance_rel_threshold`, go to the least-loaded
   worker instead (reason `imbalance`). Both gaps must hold, so a small absolute gap at low
   traffic and a small ratio at high traffic both keep affinity. Unlike the router in the seeds,
   the detector looks at the worker this request would go to, not the fleet's max: a swamped
   worker elsewhere does not cost this request its cache.
4. Spill: if the owner is busy while some worker is idle, and computing the prompt cold on the
   idle worker costs fewer tokens than the prefill work already waiting at the owner (its
   in-flight count x its recent mean uncached tokens, plus this prompt's uncached part there),
   go to the idle worker (reason `spill`). It then holds the prefix too, so a group too hot for
   one worker gains owners in proportion to its load instead of queueing behind one. (Before a
   worker has answered, the proxy counts each request in flight there as a whole prompt.)
   Only to an idle worker that has room for it (below): a replica that evicts another group's
   prefix costs the fleet a miss later. And only to one whose reused prefixes fill less than
   half its KV (`SPILL_ROOM_SHARE`): later requests reuse the copy, so a worker that protects
   reuse keeps it, and on a worker already full of other groups' prefixes it soon costs one of
   them its home (on the capacity-bound load, each spill cost the fleet more hits than the one
   prefill it saved, and lengthened the tail). Otherwise the owner (reason `cache_hit`).
   (With the exact queue of rule 5 here instead, lru workers over capacity spilled four times as
   often and lost 0.08 of hit rate: the estimate's lag keeps spills rare.)
5. No owner above the threshold (reason `cache_miss`): if the prompt would push reused prefixes
   out somewhere (damage, below), the worker where queued prefill + its uncached part + the
   damage is least, all in tokens to compute (the damage is computed again by whoever needs it
   next). Queued prefill (`Candidate.queued`): with the worker's KV events followed, the uncached
   parts of the requests sent there whose prompt's last block no event has stored yet (a worker
   caches a prompt when its prefill ends), so requests that are decoding do not count; else the
   in-flight estimate of rule 4. Otherwise, among the workers within `LOAD_SLACK` requests of the
   least loaded, the least loaded, preferring a longer match beyond the base (not the raw match:
   then, at low traffic, every new session would go to the first holder of a common system
   prompt and its history would pin it there). Remaining ties rotate (never always the first).

Capacity (when the fleet's KV is the limit): a worker whose eviction protects reused prefixes
(`/server_info` says lfu or probation; an SGLang worker's `radix_eviction_policy` lfu or slru) keeps
what was reused and churns the rest. Its *room* is its KV capacity less the reused blocks the
gateway routed there and it still holds (KV events keep that exact); a prompt's *damage* there is
the part of it that does not fit in the room, i.e. reused prefixes it would push out. Cold prompts
that no worker can keep — more groups than the fleet holds — then land where they push nothing out,
usually one worker with spare room, instead of each evicting another group's system prompt and
making it homeless in turn; groups stay partitioned. Ties among equally loaded workers go to the one
with the most room, except for a prompt that does no damage anywhere (rule 5's last case): nothing
reused is at stake, and room lags (it shrinks only when a later request reuses), so preferring it
herded new conversations onto one worker (multi-turn, 8 workers, probation: hit 0.755-0.764 against
lru's 0.767-0.771). A worker that evicts by recency alone (lru) protects nothing, so damage is zero
everywhere and the rules above are unchanged.
6. The prompt is inserted into the chosen worker's tree at selection time; `failed` undoes that
   if the request never reached the worker, and the proxy trims the tree when the worker reports
   fewer cached tokens than predicted.

Others: `round_robin`, `random`, `power_of_two` (two random workers, the less loaded), and
`prefix_hash` (consistent hashing of the first `prefix_token_count` tokens, with bounded load:
a worker already carrying `prefix_hash_load_factor` × the mean load is skipped clockwise).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.prefix_index import PrefixIndex
from radixpool.gateway.route_key import RouteKey

LOAD_SLACK = 1
SPILL_ROOM_SHARE = 0.5  # spill copies only onto workers with this share of their KV unreserved
# A held request (late binding) spills only when its cold prefill on the idle worker is at most
# 1/HELD_SPILL_MARGIN of what waits for it at its owner. It is offered again at every drain, so
# a margin of 1 (as on arrival) found an idle worker far more often and copied groups that the
# owner would have served moments later: real HTTP fleets, shared prefixes, lru workers, 8
# workers, hit 0.882 with early binding, 0.856-0.864 with late; with 2, 0.877-0.890, and the
# capacity-bound and multi-gateway figures are unchanged at seed 0.
HELD_SPILL_MARGIN = 2.0
DEMAND_WINDOW = 512  # requests per demand window; hot-prefix shares cover the last two windows
# ... or fewer: a window also ends once it counts this many distinct blocks. 512 requests of
# unique 64k-token prompts (RAG over long documents) made 2M entries a window, ~400 MB for the
# two; this keeps them under ~50 MB. Shared prompts repeat their blocks and never reach it.
DEMAND_MAX_BLOCKS = 1 << 18


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    load: int
    backlog: float = 0.0  # estimated uncached prompt tokens queued ahead (in-flight x mean)
    queued: float = 0.0   # uncached prompt tokens whose prefill has not ended (KV events)


@dataclass(slots=True)
class Decision:
    worker: str
    reason: str
    predicted_blocks: int = 0
    prior_epochs: list[int] = field(default_factory=list)


class Policy:
    name = "base"

    def select(self, candidates: Sequence[Candidate], key: RouteKey) -> Decision:
        raise NotImplementedError

    def failed(self, decision: Decision, key: RouteKey) -> None:
        """The worker never got the request (connect error, 503): undo what select assumed."""

    def place(self, candidates: Sequence[Candidate], key: RouteKey, threshold: float,
              force: bool) -> Decision | None:
        """A held request (see `wait_queue`): the pick among the workers with at most
        `threshold` tokens of prefill queued (all of them when `force`), or None to keep it."""
        open_ = [c for c in candidates if c.queued <= threshold]
        return self.select(open_ or candidates, key) if open_ or force else None


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def select(self, candidates: Sequence[Candidate], key: RouteKey) -> Decision:
        self._turn += 1
        return Decision(candidates[self._turn % len(candidates)].name, self.name)


class RandomChoice(Policy):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Candidate], key: RouteKey) -> Decision:
        return Decision(self._rng.choice(candidates).name, self.name)


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Candidate], key: RouteKey) -> Decision:
        if len(candidates) == 1:
            return Decision(candidates[0].name, self.name)
        a, b = self._rng.sample(range(len(candidates)), 2)
        pick = a if candidates[a].load <= candidates[b].load else b
        return Decision(candidates[pick].name, self.name)


class PrefixHash(Policy):
    name = "prefix_hash"
    VNODES = 160

    def __init__(self, load_factor: float) -> None:
        self.load_factor = load_factor
        self._members: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, names: tuple[str, ...]) -> None:
        if names == self._members:
            return
        ring = sorted((_point(f"{n}#{i}"), n) for n in names for i in range(self.VNODES))
        self._members = names
        self._points = [p for p, _ in ring]
        self._owners = [n for _, n in ring]

    def select(self, candidates: Sequence[Candidate], key: RouteKey) -> Decision:
        self._ring(tuple(sorted(c.name for c in candidates)))
        load = {c.name: c.load for c in candidates}
        cap = math.ceil(self.load_factor * (sum(load.values()) + 1) / len(candidates))
        start = bisect.bisect(self._points, key.prefix_key)
        first = None
        for step in range(len(self._points)):
            owner = self._owners[(start + step) % len(self._points)]
            first = first or owner
            if load[owner] < cap:
                return Decision(owner, self.name if owner == first else "overflow")
        return Decision(first, self.name)


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, index: PrefixIndex, config: GatewayConfig) -> None:
        self.index = index
        self.threshold = config.cache_threshold
        self.abs_gap = config.balance_abs_threshold
        self.rel_gap = config.balance_rel_threshold
        self.hot_factor = config.hot_prefix_factor
        self._turn = 0
        self._demand: dict[str | None, _Demand] = {}   # by model: its own traffic decides

    def _standing(self, candidates: Sequence[Candidate], key: RouteKey
                  ) -> tuple[list[int], list[int], bool]:
        """Blocks each candidate holds, those beyond what every worker (or the hot set) holds,
        and whether the best of them is an owner: a match beyond the base above the threshold."""
        depth = self.index.match(key.hashes) if key.hashes else {}
        matched = [depth.get(c.name, 0) for c in candidates]
        base = max(min(matched), self.hot_blocks(key.hashes, len(candidates), key.model))
        beyond = [max(0, m - base) for m in matched]
        rest = key.blocks - base
        return matched, beyond, rest > 0 and max(beyond) / rest > self.threshold

    def select(self, candidates: Sequence[Candidate], key: RouteKey) -> Decision:
        matched, beyond, owned = self._standing(candidates, key)
        everyone = range(len(candidates))
        best = max(beyond)
        if owned:
            owners = [i for i in everyone if beyond[i] == best]
            pick, reason = self._least_loaded(candidates, owners, beyond), "cache_hit"
            low = min(c.load for c in candidates)
            load = candidates[pick].load
            if load - low > self.abs_gap and load > low * self.rel_gap:
                pick, reason = self._least_loaded(candidates, everyone, beyond), "imbalance"
            elif load and not low:
                pick, reason = self._spill(candidates, matched, key, pick)
        else:
            pick, reason = self._least_damage(candidates, matched, key, beyond), "cache_miss"
        self._count_demand(key.hashes, key.model)
        worker = candidates[pick].name
        prior = self.index.insert(worker, key.hashes, matched[pick])
        return Decision(worker, reason, matched[pick], prior)

    def _spill(self, candidates: Sequence[Candidate], matched: list[int], key: RouteKey,
               owner: int, margin: float = 1.0) -> tuple[int, str]:
        """The owner is busy and some worker idles: go to the idle one when computing this
        prompt cold there, times `margin`, costs less than the prefill work waiting at the
        owner, in tokens."""
        idle = [i for i in range(len(candidates)) if candidates[i].load == 0
                and self._has_slack(candidates[i])
                and not self._damage(candidates[i], matched[i], key)]
        if not idle:
            return owner, "cache_hit"
        there = max(idle, key=lambda i: matched[i])
        units = key.block_tokens
        at_owner = candidates[owner].backlog + (key.blocks - matched[owner]) * units
        if (key.blocks - matched[there]) * units * margin < at_owner:
            return there, "spill"
        return owner, "cache_hit"

    def failed(self, decision: Decision, key: RouteKey) -> None:
        self.index.remove(decision.worker, key.hashes[decision.predicted_blocks:])

    def place(self, candidates: Sequence[Candidate], key: RouteKey, threshold: float,
              force: bool) -> Decision | None:
        """A held request goes where its first token comes soonest: queued prefill + its
        uncached part + the reused blocks it would push out, in tokens to compute; only once
        that worker has at most `threshold` queued (at once when `force`). A request with an
        owner (a match beyond the base above `cache_threshold`) is placed among its owners,
        or spills as in `select` (rule 4) but only with `HELD_SPILL_MARGIN` to spare: going
        cold elsewhere would often be sooner for it while a long prefill runs at its owner, but
        it costs the fleet a whole prefill and a copy of the prefix (on the capacity-bound load,
        placing on all workers by that cost alone fell from 0.85 to 0.34 hit rate; spilling by
        queued instead of rule 4's estimate, 0.77 to 0.62 with lru workers). Its demand was
        counted when it arrived."""
        matched, beyond, owned = self._standing(candidates, key)
        among = range(len(candidates))
        if owned:
            best = max(beyond)
            among = [i for i in among if beyond[i] == best]
        cost = {i: _first_token_cost(candidates[i], matched[i], key,
                                     self._damage(candidates[i], matched[i], key))
                for i in among}
        least = min(cost.values())
        pick = self._least_loaded(candidates, [i for i, x in cost.items() if x == least],
                                  beyond)
        reason = "late"
        if candidates[pick].queued > threshold and not force:
            if len(among) == len(candidates):
                return None
            pick, reason = self._spill(candidates, matched, key, pick, HELD_SPILL_MARGIN)
            if reason != "spill":
                return None
        worker = candidates[pick].name
        prior = self.index.insert(worker, key.hashes, matched[pick])
        return Decision(worker, reason, matched[pick], prior)

    def _has_slack(self, candidate: Candidate) -> bool:
        """Reused prefixes fill less than `1 - SPILL_ROOM_SHARE` of the worker's KV: a copy
        there (which later requests reuse, so the worker protects it) costs no group its home."""
        name = candidate.name
        return self.index.room(name) >= SPILL_ROOM_SHARE * self.index.capacity(name)

    def _damage(self, candidate: Candidate, matched: int, key: RouteKey) -> int:
        """Blocks of reused prefixes this prompt would push out of the candidate's cache."""
        return max(0, key.blocks - matched - self.index.room(candidate.name))

    def _least_damage(self, candidates: Sequence[Candidate], matched: list[int], key: RouteKey,
                      beyond: list[int]) -> int:
        damage = [self._damage(c, matched[i], key) for i, c in enumerate(candidates)]
        if any(damage):
            # Some worker would lose reused prefixes to it: weigh that against the wait, in
            # tokens to compute: prefill queued there + this prompt's uncached part + the
            # reused blocks it pushes out (computed again by the next request that needs them).
            cost = [_first_token_cost(c, matched[i], key, damage[i])
                    for i, c in enumerate(candidates)]
            least = min(cost)
            best = [i for i, x in enumerate(cost) if x == least]
            return self._least_loaded(candidates, best, beyond)
        low = min(c.load for c in candidates)
        near = [i for i, c in enumerate(candidates) if c.load <= low + LOAD_SLACK]
        return self._least_loaded(candidates, near, beyond, by_room=False)

    def _least_loaded(self, candidates: Sequence[Candidate], among: Sequence[int],
                      beyond: list[int], by_room: bool = True) -> int:
        low = min(candidates[i].load for i in among)
        ties = [i for i in among if candidates[i].load == low]
        if len(ties) > 1 and not by_room:
            empty = [i for i in ties if not self.index.size(candidates[i].name)]
            if empty:
                ties = empty
        if len(ties) > 1:
            top = max(beyond[i] for i in ties)
            ties = [i for i in ties if beyond[i] == top]
        if len(ties) > 1 and by_room:
            room = [self.index.room(candidates[i].name) for i in ties]
            most = max(room)
            ties = [i for i, r in zip(ties, room) if r == most]
        if len(ties) == 1:  # only a true tie turns the rotation (else its parity pins a worker)
            return ties[0]
        self._turn += 1
        return ties[self._turn % len(ties)]

    def hot_blocks(self, hashes: Sequence[int], workers: int, model: str | None = None) -> int:
        """Leading blocks requested by at least `hot_factor` workers' share of the recent
        traffic for `model` (the workers serving it are the candidates; other models' requests
        for the same text go elsewhere)."""
        demand = self._demand.get(model)
        if demand is None:
            return 0
        total = demand.requests + demand.old_requests
        if workers < 2 or total < 2 * workers or not hashes:
            return 0
        need = self.hot_factor * total / workers
        new, old = demand.new, demand.old
        # A block's demand never exceeds its parent's (every request for it also asks for the
        # parent), so demand is non-increasing along the chain: binary search for the first cold.
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi) // 2
            h = hashes[mid]
            if new.get(h, 0) + old.get(h, 0) >= need:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _count_demand(self, hashes: Sequence[int], model: str | None) -> None:
        demand = self._demand.get(model)
        if demand is None:
            demand = self._demand[model] = _Demand()
        counts = demand.new
        for h in hashes:
            counts[h] = counts.get(h, 0) + 1
        demand.requests += 1
        if demand.requests >= DEMAND_WINDOW or len(counts) >= DEMAND_MAX_BLOCKS:
            demand.old, demand.old_requests = counts, demand.requests
            demand.new, demand.requests = {}, 0


@dataclass(slots=True)
class _Demand:
    """Requests per block over the current and the previous demand window, for one model."""

    new: dict[int, int] = field(default_factory=dict)
    old: dict[int, int] = field(default_factory=dict)
    requests: int = 0
    old_requests: int = 0


def make_policy(config: GatewayConfig, index: PrefixIndex) -> Policy:
    if config.policy == "cache_aware":
        return CacheAware(index, config)
    if config.policy == "round_robin":
        return RoundRobin()
    if config.policy == "random":
        return RandomChoice()
    if config.policy == "power_of_two":
        return PowerOfTwo()
    return PrefixHash(config.prefix_hash_load_factor)


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _first_token_cost(candidate: Candidate, matched: int, key: RouteKey, damage: int) -> float:
    """When the request's first token would come on `candidate`, in tokens to compute: prefill
    queued there + its uncached part + the reused blocks it would push out (computed again by
    the next request that needs them)."""
    return candidate.queued + (key.blocks - matched + damage) * key.block_tokens
