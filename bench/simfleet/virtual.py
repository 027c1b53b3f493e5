"""A fleet in virtual time: the gateway's own routing (policy, prefix index, feedback) in front of
workers running the engine's own radix cache, with no HTTP and no wall clock, so a seeded run
gives the same figures on any machine, loaded or not.

What is real: `make_policy` / `PrefixIndex` / `KeyBuilder` / `Worker` (in-flight counts, mean
uncached tokens, backlog, the queued prefill that KV events end) from the gateway, the trim on a
short `cached_tokens` report (`first_missing_block` + `trim_through`, as the proxy does), the
workers' KV events applied to every gateway's index and queue (as the monitor does), and
`SimKV` (`RadixCache` with its eviction policy) on the workers. What is modelled: prefill
costs `prefill_us_per_token` per uncached token, and a worker schedules it one of two ways
(`FleetModel.schedule`):
- `fifo` (issue 18's workload): one prefill at a time, in arrival order;
- `engine`, the engine's own scheduler (`worker/scheduler`) in outline: steps of at most
  `step_tokens` prompt tokens (`max_prefill_tokens`), each costing its tokens; a prompt takes at
  most `chunk_tokens` a step (`chunked_prefill_size`); prompts mid-prefill go first, then waiting
  ones in longest-cached-prefix order (ties by arrival), at most one of them cut short a step; a
  waiting prompt whose uncached blocks a prompt mid-prefill is computing waits for it (the
  engine's in-batch de-duplication), then hits.
Decode then takes `decode_ms_per_token` per output token and overlaps freely; KV events reach
the gateways the instant a prompt's prefill ends (a real stream takes a few milliseconds; the
engine also stores each chunk as it goes).

Idleness: `idle_while_queued` is the time some worker has nothing to do (no prefill running or
queued) while a request waits: in another worker's prefill queue (not yet started), or held
by a gateway (late binding); `idle_avoidable` is the part of it when some waiting request would
get its first token sooner on an idle worker, cold or not (a held one is compared with the tail
of the busy worker where it would start soonest). With the `engine` schedule a waiting prompt's
own finish is taken at its earliest (the running step's end plus its own uncached tokens), so
`idle_avoidable` errs towards counting idleness as avoidable. The rest is idleness no routing
decision could have turned into an earlier first token.

Several gateways: each request goes to one of them at random (clients spread over replicas);
each knows the in-flight requests it sent itself, while all of them receive every KV event and,
with `FleetModel.load_reports` (as our workers do), each worker's load: the requests it holds,
said with each answer that carries events and `LOAD_LINGER_S` after it changes (the `/kv_events`
long poll's own timing). A gateway counts a worker's load as its own requests there plus the
others' as of the last report (`Worker.load`). With `FleetModel.announcements` (ours do), each
worker also says which prompt it queued (a `queued` event from the engine's own
`RadixCache.announce`): every gateway puts it in that worker's tree, as its own routing decisions
go there. When: with the `engine` schedule, the core takes requests in between steps, so the
event leaves when the step under way ends (at once on an idle worker), or, with
`FleetModel.announce_at` "step" (our workers before they sent the intake's events at once), with
the output of the step after that; with `fifo`, `ANNOUNCE_DELAY_S` after the request arrived.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from radixpool.gateway.breaker import CircuitBreaker
from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.feedback import first_missing_block, prefill_wait
from radixpool.gateway.health import HealthHysteresis
from radixpool.gateway.policies import Decision, make_policy
from radixpool.gateway.prefix_index import PrefixIndex
from radixpool.gateway.route_key import KeyBuilder, RouteKey
from radixpool.gateway.wait_queue import Held, LateBinding
from radixpool.gateway.workers import Worker, candidates
from radixpool.protocol.kv_blocks import KVEvent
from radixpool.protocol.server_info import ServerInfo
from radixpool.worker.kv_event_log import LOAD_LINGER_S

from .kv import SimKV
from .sglang_eviction import reported


@dataclass(frozen=True)
class Request:
    arrival: float
    tokens: list[int]
    group: int = 0          # workload's own label (the partition reference routes on it)
    output_tokens: int = 32


SCHEDULES = ("fifo", "engine")
# fifo workers (not our engine's steps): a `queued` event reaches the gateways this long after its
# request reached the worker.
ANNOUNCE_DELAY_S = 0.01
ANNOUNCE_AT = ("intake", "step")   # engine: when the taken-in requests' events leave the core
DEDUP_MIN_TOKENS = 32   # the engine's DEDUP_MIN_BLOCKS (2) blocks of 16
WARMUP_SHARE = 0.1      # `Outcome.steady_latencies` leaves out the first tenth of the arrivals


@dataclass(frozen=True)
class FleetModel:
    workers: int
    kv_capacity_tokens: int
    eviction_policy: str = "lru"
    block_size: int = 16
    prefill_us_per_token: float = 20.0
    decode_ms_per_token: float = 5.0
    schedule: str = "fifo"           # or "engine": chunked steps in cached-prefix order
    load_reports: bool = True        # the KV stream says each worker's load (ours does)
    announcements: bool = True       # ... and each prompt it queues (`queued` events)
    announce_at: str = "intake"      # engine: at intake (ours), or after the next step (before)
    chunk_tokens: int = 2048         # engine: EngineConfig.chunked_prefill_size
    step_tokens: int = 8192          # engine: EngineConfig.max_prefill_tokens

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.announce_at not in ANNOUNCE_AT:
            raise ValueError(f"announce_at must be one of {ANNOUNCE_AT}, got {self.announce_at!r}")


@dataclass
class Outcome:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)   # of the requests in `latencies`
    ttfts: list[float] = field(default_factory=list)
    per_worker: list[int] = field(default_factory=list)
    busy_time: float = 0.0
    idle_while_queued: float = 0.0   # some worker idle while another has a prefill queued
    idle_avoidable: float = 0.0      # ... and a queued request would start sooner on it
    reasons: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def steady_latencies(self, warmup_share: float = WARMUP_SHARE) -> list[float]:
        """Latencies of the requests that arrived after the first `warmup_share` of the
        arrivals: the run once every cache has warmed up (at the start every prompt is cold,
        so a few dozen requests queue behind cold prefills that later ones never see)."""
        if not self.arrivals:
            return []
        cutoff = sorted(self.arrivals)[int(warmup_share * len(self.arrivals))]
        return [lat for lat, t in zip(self.latencies, self.arrivals) if t >= cutoff]


class _Gateway:
    """One gateway replica: its own index, policy and in-flight counts."""

    def __init__(self, config: GatewayConfig, model: FleetModel, names: list[str]) -> None:
        self.index = PrefixIndex()
        self.policy = make_policy(config, self.index)
        self.workers = {n: Worker(n, HealthHysteresis(1, 1), CircuitBreaker(5, 10.0),
                                  kv_events_live=True) for n in names}
        schedule = "lpm" if model.schedule == "engine" else "fcfs"
        for n in names:  # what the monitor learns from each worker's /server_info
            self.index.add_worker(n, model.kv_capacity_tokens // model.block_size)
            self.index.set_eviction_policy(n, reported(model.eviction_policy))
            self.workers[n].info = ServerInfo(
                "sim", "sim", 1 << 20, model.kv_capacity_tokens, 1, model.block_size, n, "sim",
                eviction_policy=reported(model.eviction_policy), schedule_policy=schedule)
        self.binding = LateBinding(self.policy, config.hold_queued_tokens,
                                   config.hold_max_requests, config.hold_max_seconds
                                   ) if config.late_binding else None

    def route(self, key: RouteKey, now: float) -> Decision | Held:
        """The proxy's first attempt: a decision, or the request held by late binding."""
        ready = list(self.workers.values())
        decision = self.policy.select(candidates(ready, key), key)
        worker = self.workers[decision.worker]
        if self.binding is not None and self.binding.holds(worker, decision, key):
            self.policy.failed(decision, key)
            return self.binding.queue.hold(key, now)
        worker.take(prefill_wait(decision, key))
        return decision

    def release(self, now: float) -> list[Held]:
        if self.binding is None:
            return []
        ready = list(self.workers.values())
        return self.binding.release(now, lambda model: ready)

    def reported(self, name: str, load: int) -> None:
        """A `/kv_events` answer said the worker holds `load` requests."""
        self.workers[name].observe_load(load)

    def stored(self, name: str, event: KVEvent) -> None:
        self.index.apply_event(name, event)
        if event.type == "stored":
            self.workers[name].prefill_stored(event.blocks)

    def learn(self, name: str, decision: Decision, key: RouteKey, prompt: int,
              cached: int) -> None:
        worker = self.workers[name]
        worker.give_back(prefill_wait(decision, key))
        worker.observe_uncached(prompt - cached)
        missing = first_missing_block(decision, key, prompt, cached)
        if missing is not None and missing < len(decision.prior_epochs):
            self.index.trim_through(name, decision.prior_epochs[missing])


@dataclass
class _Job:
    request: Request
    key: RouteKey
    gateway: _Gateway | None
    decision: Decision | None
    worker: int
    cached: int = 0
    match: object = None
    left: int = 0           # engine: uncached tokens not computed yet (set when admitted)


class _SimWorker:
    def __init__(self, model: FleetModel) -> None:
        self.kv = SimKV(model.kv_capacity_tokens, model.block_size, model.eviction_policy,
                        event_buffer=1)
        self.queue: deque[_Job] = deque()     # waiting, not started
        self.running: _Job | None = None      # fifo: the prefill under way
        self.running_until = 0.0              # when the prefill (fifo) or step (engine) ends
        self.started: list[_Job] = []         # engine: prompts mid-prefill, admission order
        self.load = 0                         # requests here, prefill to last token
        self.report_due = False               # a load answer is lingering (LOAD_LINGER_S)
        self.step: list[tuple[_Job, int]] = []   # engine: the step under way, tokens each
        # engine: `queued` events of requests that arrived during the step under way (the core
        # takes them in when it ends), and of those taken in whose events leave with the output
        # of the step under way (announce_at "step")
        self.arrived: list[list[KVEvent]] = []
        self.taken_in: list[list[KVEvent]] = []

    @property
    def idle(self) -> bool:
        return self.running is None and not self.queue and not self.started

    def form_step(self, model: FleetModel) -> list[tuple[_Job, int]]:
        """The engine's admission (`PrefillAdder`), for one step: prompts mid-prefill first,
        then waiting ones by longest cached prefix, within the step's and each prompt's token
        budget, at most one prompt cut short."""
        budget, step, cut = model.step_tokens, [], False
        for job in self.started:
            take = min(job.left, model.chunk_tokens, budget)
            if take <= 0:
                break
            cut = cut or take < job.left
            step.append((job, take))
            budget -= take
        # (admitting only locks: the cache, and so each prompt's cached length, stays as it is)
        cached_now = {id(j): self.kv.probe(j.request.tokens, None) for j in self.queue}
        for job in sorted(self.queue, key=lambda j: -cached_now[id(j)]):
            if budget <= 0:
                break
            if self._computed_by_another(job, cached_now[id(job)]):
                continue
            cached, match = self.kv.start(job.request.tokens, None)
            need = len(job.request.tokens) - cached
            take = min(need, model.chunk_tokens, budget)
            if take < need and cut:
                self.kv.cache.unlock(match.node)
                break
            cut = cut or take < need
            job.cached, job.match, job.left = cached, match, need
            self.queue.remove(job)
            self.started.append(job)
            step.append((job, take))
            budget -= take
        return step

    def _computed_by_another(self, job: _Job, cached: int) -> bool:
        """A prompt mid-prefill is computing the start of `job`'s uncached part."""
        tokens = job.request.tokens
        ahead = tokens[cached:cached + DEDUP_MIN_TOKENS]
        return len(ahead) == DEDUP_MIN_TOKENS and any(
            other.request.tokens[cached:cached + DEDUP_MIN_TOKENS] == ahead
            for other in self.started)


def _avoidable(workers: list[_SimWorker], held: list[Request], now: float,
               model: FleetModel) -> bool:
    """Some worker idles while a waiting request would get its first token sooner on it: its
    prefill there (cold or partly cached) would end before its own prefill ends where it waits.
    A request held by the gateway waits, at best, behind the queue of the busy worker where its
    prefill would end soonest. Costs read each cache as it is now. fifo: a queued prompt ends
    after everything ahead of it; engine: at the earliest, the running step's end plus its own
    uncached tokens (steps batch prompts, so what is ahead may share its step)."""
    idle = [w for w in workers if w.idle]
    if not idle:
        return False
    per_token = model.prefill_us_per_token / 1e6

    def uncached(w: _SimWorker, tokens: list[int]) -> float:
        return (len(tokens) - w.kv.probe(tokens, None)) * per_token

    def sooner_on_idle(tokens: list[int], ready: float) -> bool:
        return any(now + uncached(i, tokens) < ready for i in idle)

    fifo = model.schedule == "fifo"
    tails = {}
    for w in workers:
        ready = max(now, w.running_until)
        step_end = ready
        for job in w.queue:
            tokens = job.request.tokens
            end = (ready if fifo else step_end) + uncached(w, tokens)
            if fifo:
                ready = end
            if sooner_on_idle(tokens, end):
                return True
        if not w.idle:
            tails[w] = ready
    for request in held:
        tokens = request.tokens
        best = min(tail + uncached(w, tokens) for w, tail in tails.items())
        if sooner_on_idle(tokens, best):
            return True
    return False


Router = Callable[[Request, RouteKey], tuple[_Gateway | None, Decision | None, int]]


def simulate(requests: list[Request], model: FleetModel, policy: str | None = "cache_aware",
             gateways: int = 1, sticky: Callable[[Request], int] | None = None,
             seed: int = 0, gateway_config: GatewayConfig | None = None,
             conserving: bool = False) -> Outcome:
    """Play `requests` (sorted by arrival) through the fleet. Routing: `policy` on `gateways`
    replicas, `sticky(request) -> worker index` (a reference that ignores load), or, with
    `conserving`, the work-conserving reference: no worker ever idles while a request waits.
    It sees every worker's cache as it is: a request that finds a worker idle goes to the idle
    one holding the longest prefix of it (cold if none holds any), else waits in one queue for
    the whole fleet, and a worker that falls idle takes the waiting request it holds the
    longest prefix of (ties: the oldest)."""
    names = [f"w{i}" for i in range(model.workers)]
    base = gateway_config or GatewayConfig()
    replicas = [] if sticky or conserving else [
        _Gateway(replace(base, policy=policy), model, names) for _ in range(gateways)]
    keys = KeyBuilder(64, base.prefix_token_count)
    keys.block_size = model.block_size
    pick_gateway = random.Random(seed)
    workers = [_SimWorker(model) for _ in names]
    out = Outcome(per_worker=[0] * model.workers)
    heap: list[tuple[float, int, str, _Job | None]] = []
    order = itertools.count()
    for r in requests:
        heapq.heappush(heap, (r.arrival, next(order), "arrive", r))  # type: ignore[arg-type]
    now = 0.0
    held: dict[Held, Request] = {}
    waiting: list[tuple[Request, RouteKey]] = []   # conserving: the fleet's one queue, by arrival

    def enqueue(request: Request, key: RouteKey, gateway: _Gateway | None,
                decision: Decision | None, w: int) -> None:
        if decision is not None:
            out.reasons[decision.reason] = out.reasons.get(decision.reason, 0) + 1
        workers[w].queue.append(_Job(request, key, gateway, decision, w))
        out.per_worker[w] += 1
        load_changed(w, +1)
        if model.announcements and replicas:
            events = workers[w].kv.announce(request.tokens, None)
            if model.schedule == "fifo":
                announce(w, events, ANNOUNCE_DELAY_S)
            elif workers[w].step:
                workers[w].arrived.append(events)   # taken in when the step under way ends
            else:
                intake(w, [events])
        start_next(w)

    def announce(w: int, events: list[KVEvent], delay: float = 0.0) -> None:
        heapq.heappush(heap, (now + delay, next(order), "queued", (w, events)))  # type: ignore

    def intake(w: int, arrived: list[list[KVEvent]]) -> None:
        """The engine's core takes in requests between steps: their `queued` events leave at
        once, or (announce_at "step") with the output of the step it runs next."""
        for events in arrived:
            if model.announce_at == "intake":
                announce(w, events)
            else:
                workers[w].taken_in.append(events)

    def load_changed(w: int, change: int) -> None:
        """A request arrived at or left worker `w`: its KV stream answers the gateways watching
        its load `LOAD_LINGER_S` later (one answer for a burst)."""
        worker = workers[w]
        worker.load += change
        if model.load_reports and not worker.report_due:
            worker.report_due = True
            heapq.heappush(heap, (now + LOAD_LINGER_S, next(order), "load", w))  # type: ignore

    def report_load(w: int) -> None:
        if model.load_reports:
            for g in replicas:
                g.reported(names[w], workers[w].load)

    def prefilled(job: _Job) -> None:
        """A prompt's prefill ended: cache it, tell every gateway (the answer carrying its
        events says the worker's load too), start its decode."""
        events = workers[job.worker].kv.finish(job.request.tokens, None, job.match)
        for g in replicas:
            for event in events:
                g.stored(names[job.worker], event)
        if events:
            report_load(job.worker)
        out.ttfts.append(now - job.request.arrival)
        decode = job.request.output_tokens * model.decode_ms_per_token / 1e3
        heapq.heappush(heap, (now + decode, next(order), "done", job))

    def release() -> None:
        for g in replicas:
            for h in g.release(now):
                decision = h.decision
                enqueue(held.pop(h), h.key, g, decision, names.index(decision.worker))

    def feed() -> None:
        """conserving: while a worker idles and a request waits, the pair with the longest
        cached prefix starts (ties: the oldest request, then the emptiest cache)."""
        while waiting:
            idle = [w for w, worker in enumerate(workers) if worker.idle]
            if not idle:
                return
            _, oldest, _, w = max((workers[w].kv.probe(r.tokens, None), -i,
                                   -workers[w].kv.usage(), w)
                                  for i, (r, _) in enumerate(waiting) for w in idle)
            request, key = waiting.pop(-oldest)
            enqueue(request, key, None, None, w)

    def start_next(w: int) -> None:
        worker = workers[w]
        if model.schedule == "engine":
            if worker.step or not (worker.queue or worker.started):
                return
            worker.step = worker.form_step(model)
            assert worker.step, "an engine with prompts to compute always makes progress"
            cost = sum(take for _, take in worker.step) * model.prefill_us_per_token / 1e6
            worker.running_until = now + cost
            heapq.heappush(heap, (now + cost, next(order), "stepped", w))  # type: ignore[arg-type]
            return
        if worker.running is not None or not worker.queue:
            return
        job = worker.queue.popleft()
        worker.running = job
        job.cached, job.match = worker.kv.start(job.request.tokens, None)
        cost = (len(job.request.tokens) - job.cached) * model.prefill_us_per_token / 1e6
        worker.running_until = now + cost
        heapq.heappush(heap, (now + cost, next(order), "prefilled", job))

    while heap:
        t, _, kind, item = heapq.heappop(heap)
        busy = [not w.idle for w in workers]
        if any(busy):
            out.busy_time += t - now
            if (held or waiting or any(w.queue for w in workers)) and not all(busy):
                out.idle_while_queued += t - now
                if _avoidable(workers, [*held.values(), *(r for r, _ in waiting)], now, model):
                    out.idle_avoidable += t - now
        now = t
        if kind == "arrive":
            request: Request = item  # type: ignore[assignment]
            key = keys.build("/generate", {"input_ids": request.tokens})
            if sticky:
                enqueue(request, key, None, None, sticky(request))
                continue
            if conserving:
                waiting.append((request, key))
                feed()
                continue
            gateway = replicas[pick_gateway.randrange(len(replicas))]
            routed = gateway.route(key, now)
            if isinstance(routed, Held):
                held[routed] = request
                heapq.heappush(heap, (now + base.hold_max_seconds, next(order), "overdue", None))
                release()
            else:
                enqueue(request, key, gateway, routed, names.index(routed.worker))
        elif kind == "overdue":
            release()
        elif kind == "queued":
            w, events = item  # type: ignore[misc]
            for g in replicas:
                for event in events:
                    g.index.apply_event(names[w], event)
            report_load(w)   # the answer that carries the events says the load too
        elif kind == "load":
            w: int = item  # type: ignore[no-redef]
            workers[w].report_due = False
            report_load(w)
        elif kind == "prefilled":
            job: _Job = item  # type: ignore[no-redef]
            prefilled(job)
            workers[job.worker].running = None
            start_next(job.worker)
            release()
            feed()
        elif kind == "stepped":
            w: int = item  # type: ignore[no-redef]
            worker = workers[w]
            for events in worker.taken_in:   # they leave with this step's output
                announce(w, events)
            worker.taken_in = []
            intake(w, worker.arrived)
            worker.arrived = []
            for job, take in worker.step:
                job.left -= take
                if job.left <= 0:
                    worker.started.remove(job)
                    prefilled(job)
            worker.step = []
            start_next(w)
            release()
            feed()
        else:
            job = item  # type: ignore[assignment]
            prompt = len(job.request.tokens)
            out.prompt_tokens += prompt
            out.cached_tokens += job.cached
            out.latencies.append(now - job.request.arrival)
            out.arrivals.append(job.request.arrival)
            load_changed(job.worker, -1)
            if job.gateway is not None:
                job.gateway.learn(names[job.worker], job.decision, job.key, prompt, job.cached)
                release()
    return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def virtual_workload(name: str, workers: int, count: int, rate: float, seed: int
                     ) -> list[Request]:
    """`bench/routing.py`'s shared-prefix and multi-turn workloads, as token ids with Poisson
    arrivals at `rate` per worker: shared-prefix, a 128-token prefix common to all + one of 2N
    768-token group prompts + 32 tokens of its own; multi-turn, 4N conversations, each turn
    adding 64 tokens to the whole history (and an 8-token answer after it)."""
    rng = random.Random(seed)
    common = random.Random(-1).choices(range(32000), k=128)
    groups = [random.Random(g).choices(range(32000), k=768) for g in range(2 * workers)]
    sessions: dict[int, list[int]] = {}
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate * workers)
        if name == "shared-prefix":
            g = rng.randrange(2 * workers)
            out.append(Request(t, common + groups[g] + rng.choices(range(32000), k=32), g, 8))
            continue
        sid = rng.randrange(4 * workers)
        history = sessions.setdefault(sid, [])
        if len(history) >= 8 * 72:
            history.clear()
        history += rng.choices(range(32000), k=64)
        out.append(Request(t, list(history), sid, 8))
        history += random.Random(-2).choices(range(32000), k=8)  # the (fixed) answer
    return out
