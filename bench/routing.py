"""Routing benchmark: a fleet of simulated workers behind a real gateway, on loopback.

    python bench/routing.py quality            # 2-16 workers x 3 workloads x 2 policies
    python bench/routing.py quality --workers 4 --workloads shared-prefix --policies cache_aware
    python bench/routing.py gateways           # hit rate with 1, 2, 3 gateways (virtual time)
    python bench/routing.py overhead           # what the gateway itself adds (zero-time workers)
    python bench/routing.py quality --omit-cached-tokens   # workers that never report cached_tokens

Three processes: the simulated fleet (`python -m bench.simfleet --count N`: each worker the
engine's own bounded radix cache, `--eviction-policy` included, whose prefills run one at a time
and cost `--prefill-us-per-token` per uncached token, so routing quality shows up as latency),
the gateway (`radixpool gateway`, whose
CPU time is read from /proc), and this load generator (closed loop, `--concurrency-per-worker`
clients per worker, streamed requests).

`quality` prints, per run: throughput, latency and TTFT percentiles, the fleet's actual hit rate
(cached / prompt tokens as the workers reported them), the gateway's predicted hit rate, gateway
CPU per request, and the share of busy time some worker sat idle while another had prefills
queued (flagged `IDLE!` above 5%: a routing failure).

Workloads (token counts exact: the simulated tokenizer is one token per word):
  shared-prefix  a 128-token system prompt common to all + one of 2N 768-token group prompts
                 + a 32-token question
  common-prefix  one 1024-token system prompt shared by every request + a 64-token question
                 (the case where pinning to the first holder would idle the fleet)
  multi-turn     4N conversations, each turn adds a 64-token user message to the whole history
  random         unrelated 512-token prompts
  capacity-bound the fleet's KV cache is the limit (issue 18): 64 groups, each an 8,192-token
                 system prompt + one of 64 distinct 512-token questions (never repeated in a
                 run), 32 output tokens, Poisson arrivals at 6 req/s per worker, 131,072 tokens
                 of KV per worker (16 system prompts). Played in virtual time
                 (`bench.simfleet.virtual`: the gateway's own policy, index and feedback, the
                 engine's own radix cache, no HTTP), so the figures are deterministic. Beside
                 each policy: the capacity reference (one unbounded cache, no load: the best any
                 routing could do), the fleet bound (N workers hold at most N x 16 of the 64
                 system prompts at once and the next request's group is uniform: no router
                 that cannot see the future reuses more), the partition reference (group g
                 always on worker g mod N, ignoring load) and the work-conserving reference
                 (ref:conserving: no worker ever idles while a request waits; it reads every
                 cache as it is, sends a request to the idle worker holding most of it, else
                 queues it fleet-wide for the first worker to fall idle), for every
                 `--eviction-policies` entry. st99: the p99 latency of the requests that
                 arrived after the first tenth of the run (every cache warm; the virtual
                 runs). idle-q:
                 share of busy time some worker had nothing to do while another had a prefill
                 queued; idle-av: the part of it when some queued request would have got its
                 first token sooner on an idle worker (its prefill there, cold or not, ends
                 before its turn and prefill where it waits): the idleness routing could avoid.
                 `--capacity-hot-share S` gives one group S of the requests (a group too hot
                 for one worker when S x rate x N x its cached prefill time > 1).
                 `--capacity-schedules fifo engine`: the workers compute prefill one at a time
                 in arrival order (fifo, the issue's workload), or as the engine schedules it
                 (engine: steps of at most 8,192 prompt tokens, at most 2,048 per prompt,
                 prompts mid-prefill first, then the longest cached prefix first, a prompt
                 whose uncached start another is computing waiting for it).

`overhead` measures, with zero-service-time workers: p50 added latency of a non-streamed request
(via gateway minus direct; one request at a time, the two paths taken in turn so a drift in
the machine's speed touches both alike), the same for the first byte of a stream, and peak
throughput with the gateway's CPU time per request.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import sys

import httpx
from fleet_procs import cpu_seconds, decision_counts, spawn_fleet, spawn_gateway, stop
from loadgen import Sample, Workload, closed_loop, interleaved, pct, words
from simfleet.sglang_eviction import BENCH_EVICTION_POLICIES
from simfleet.virtual import (
    ANNOUNCE_AT,
    SCHEDULES,
    FleetModel,
    Request,
    percentile,
    simulate,
    virtual_workload,
)

from radixpool.gateway.config import GatewayConfig


# --- quality --------------------------------------------------------------------------------------
def quality_run(n: int, workload: str, policy: str, args: argparse.Namespace) -> str:
    fleet, urls = spawn_fleet(n, args)
    try:
        gateway, port = spawn_gateway(urls, policy, args.gateway_arg, args.gateway_src)
    except BaseException:
        stop(fleet)
        raise
    try:
        wl = Workload(workload, n)

        def make(i: int) -> tuple[str, bytes]:
            return "/v1/chat/completions", json.dumps(wl.next(i, args.max_tokens)).encode()

        httpx.delete(urls[0] + "/sim/stats")
        cpu0 = cpu_seconds(gateway.pid)
        total = args.requests_per_worker * n
        samples, elapsed = asyncio.run(closed_loop(port, make, args.concurrency_per_worker * n,
                                                   total, None))
        cpu = cpu_seconds(gateway.pid) - cpu0
        stats = httpx.get(urls[0] + "/sim/stats").json()
        fleet_doc = httpx.get(f"http://127.0.0.1:{port}/workers").json()["fleet"]
        reasons = decision_counts(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
    finally:
        stop(gateway)
        stop(fleet)
    lat = [s.latency * 1e3 for s in samples]
    ttft = [s.ttft * 1e3 for s in samples]
    idle = stats["idle_while_queued_samples"] / max(1, stats["busy_samples"])
    spread = stats["requests"]
    return (f"{n:>3} {workload:<13} {policy:<12} {len(samples) / elapsed:8.1f} "
            f"{pct(lat, 0.5):7.1f} {pct(lat, 0.99):7.1f} {pct(ttft, 0.5):7.1f} "
            f"{pct(ttft, 0.99):7.1f} {stats['hit_rate']:6.3f} "
            f"{fleet_doc['predicted_hit_rate']:6.3f} {cpu / len(samples) * 1e6:7.0f} "
            f"{idle:6.1%}{' IDLE!' if idle > 0.05 else ''}  min/max per worker "
            f"{min(spread)}/{max(spread)}  {reasons}")


def quality(args: argparse.Namespace) -> None:
    if "capacity-bound" in args.workloads:
        capacity(args)
    args.workloads = [w for w in args.workloads if w != "capacity-bound"]
    if not args.workloads:
        return
    print(f"# gateway flags: {' '.join(args.gateway_arg) or '(defaults)'}; gateway source: "
          f"{args.gateway_src or 'this checkout'}; worker eviction: {args.eviction_policy}")
    if args.omit_cached_tokens:
        print("# simulated workers leave cached_tokens out of their answers")
    print(f"# simulated workers: prefill {args.prefill_us_per_token} us/uncached token "
          f"(one prefill at a time), decode {args.decode_ms_per_token} ms/token x "
          f"{args.max_tokens}, KV {args.kv_capacity_tokens} tokens/worker; "
          f"{args.concurrency_per_worker} clients/worker, {args.requests_per_worker} req/worker")
    print("  N workload      policy          req/s  lat50ms  lat99  ttft50  ttft99 actual "
          "predic  cpu_us idle-q")
    for n in args.workers:
        for workload in args.workloads:
            for policy in args.policies:
                print(quality_run(n, workload, policy, args), flush=True)


# --- capacity-bound (virtual time) ---------------------------------------------------------------
GROUPS, SYSTEM_TOKENS, QUESTION_TOKENS = 64, 8192, 512


def capacity_workload(workers: int, count: int, seed: int, hot_share: float = 0.0,
                      rate: float = 6.0) -> list[Request]:
    """Issue 18's workload: `count` requests over 64 groups x 64 distinct questions, `rate`
    per second per worker. With `hot_share`, group 0 takes that share of the requests (each
    with a question of its own) and the other 63 groups the rest."""
    rng = random.Random(seed)
    systems = [random.Random(1000 + g).choices(range(32000), k=SYSTEM_TOKENS)
               for g in range(GROUPS)]
    pairs = [(g, q) for g in range(GROUPS) for q in range(64)]
    rng.shuffle(pairs)
    if hot_share:
        cold, hot = iter([p for p in pairs if p[0]]), itertools.count()
        pairs = [(0, next(hot)) if rng.random() < hot_share else next(cold)
                 for _ in range(count)]
    t, out = 0.0, []
    for g, q in pairs[:count]:
        t += rng.expovariate(rate * workers)
        question = random.Random(g * 64 + q if q < 64 else f"hot{q}").choices(
            range(32000), k=QUESTION_TOKENS)
        out.append(Request(t, systems[g] + question, g, 32))
    return out


def capacity_bound(workers: int, kv_tokens: int) -> float | None:
    """The most any routing can reuse on the uniform `capacity_workload`: the fleet holds at most
    `workers x (kv_tokens // 8,192)` of the 64 system prompts at once, the next request's group is
    uniform, and a request that finds its system prompt reuses 8,192 of its 8,704 tokens. None
    when every system prompt fits (the capacity reference is the bound then)."""
    held = workers * (kv_tokens // SYSTEM_TOKENS)
    if held >= GROUPS:
        return None
    return held / GROUPS * SYSTEM_TOKENS / (SYSTEM_TOKENS + QUESTION_TOKENS)


SCHEDULE_TEXT = {
    "fifo": "FIFO, one at a time",
    "engine": "the engine's steps: chunks of 2048, 8192 tokens a step, cached prefix first",
}


def capacity(args: argparse.Namespace) -> None:
    for schedule in args.capacity_schedules:
        capacity_table(args, schedule)


def capacity_table(args: argparse.Namespace, schedule: str) -> None:
    print(f"# capacity-bound, virtual time (deterministic, seed {args.seed}): "
          f"{args.capacity_requests} requests, prefill {args.capacity_prefill_us} us/uncached "
          f"token ({SCHEDULE_TEXT[schedule]}), decode {args.capacity_decode_ms} ms/token x 32, "
          f"KV {args.capacity_kv_tokens} tokens/worker, {args.capacity_rate} req/s per worker"
          + (f", group 0 takes {args.capacity_hot_share:.0%} of the requests"
             if args.capacity_hot_share else ""))
    print("  N evict     routing            hit  lat50ms  lat99  st99  ttft50  ttft99 idle-q "
          "idle-av  min/max per worker  decisions")
    for n in args.workers:
        requests = capacity_workload(n, args.capacity_requests, args.seed,
                                     args.capacity_hot_share, args.capacity_rate)
        for eviction in args.eviction_policies:
            model = FleetModel(n, args.capacity_kv_tokens, eviction,
                               prefill_us_per_token=args.capacity_prefill_us,
                               decode_ms_per_token=args.capacity_decode_ms, schedule=schedule)
            unbounded = FleetModel(1, 1 << 40, eviction, prefill_us_per_token=0,
                                   decode_ms_per_token=0)
            rows = [("ref:capacity", simulate(requests, unbounded, sticky=lambda r: 0)),
                    ("ref:partition", simulate(requests, model, sticky=lambda r, n=n: r.group % n)),
                    ("ref:conserving", simulate(requests, model, conserving=True))]
            rows += [(p + late, simulate(requests, model, p, gateway_config=config))
                     for p in args.policies for late, config in bindings(args)]
            for name, o in rows:
                lat = [x * 1e3 for x in o.latencies]
                ttft = [x * 1e3 for x in o.ttfts]
                idle = o.idle_while_queued / o.busy_time if o.busy_time else 0.0
                avoidable = o.idle_avoidable / o.busy_time if o.busy_time else 0.0
                steady = [x * 1e3 for x in o.steady_latencies()]
                lat_cols = ("      -       -     -       -       -" if name == "ref:capacity"
                            else f"{percentile(lat, 0.5):7.0f} {percentile(lat, 0.99):7.0f} "
                            f"{percentile(steady, 0.99):5.0f} "
                            f"{percentile(ttft, 0.5):7.0f} {percentile(ttft, 0.99):7.0f}")
                reasons = " ".join(f"{k}={v}" for k, v in sorted(o.reasons.items()))
                print(f"{n:>3} {eviction:<9} {name:<15} {o.hit_rate:6.3f} {lat_cols} "
                      f"{idle:6.1%} {avoidable:7.1%}  "
                      f"{min(o.per_worker):>6}/{max(o.per_worker):<6}        {reasons}", flush=True)
                bound = capacity_bound(n, args.capacity_kv_tokens)
                if name == "ref:capacity" and bound is not None and not args.capacity_hot_share:
                    print(f"{n:>3} {eviction:<9} {'ref:bound':<15} {bound:6.3f}")


def bindings(args: argparse.Namespace) -> list[tuple[str, GatewayConfig]]:
    """The gateway configs the virtual rows run: early binding, late binding, or both."""
    early = GatewayConfig(late_binding=False)
    late = GatewayConfig(late_binding=True, hold_queued_tokens=args.hold_queued_tokens)
    return [(name, config) for name, config in (("", early), ("+late", late))
            if (name or "+early")[1:] in args.binding]


# --- several gateways (virtual time) --------------------------------------------------------------
def gateways(args: argparse.Namespace) -> None:
    print(f"# several gateways, virtual time (deterministic, seed {args.seed}): each request goes "
          f"to a random gateway; every gateway gets every worker's KV events; "
          f"{args.requests_per_worker} req/worker at {args.rate} req/s per worker, prefill "
          f"{args.prefill_us_per_token} us/uncached token, decode 1 ms/token x 8, KV "
          f"{args.kv_capacity_tokens} tokens/worker, worker eviction {args.eviction_policy}, "
          f"prefill {SCHEDULE_TEXT[args.schedule]}; load / queued: whether the workers' KV "
          f"streams say their load / name the prompts they queue"
          + ("" if args.schedule == "fifo" else
             " (intake: as the core takes them in; step: with the output of the step after "
             "that)"))
    print("  N workload      gateways       load queued   hit  lat50ms  lat99  st99 idle-q "
          "idle-av  min/max per worker")
    for n in args.workers:
        for workload in ("shared-prefix", "multi-turn"):
            requests = virtual_workload(workload, n, args.requests_per_worker * n, args.rate,
                                        args.seed)
            for g, (late, config), reports, (queued, at) in itertools.product(
                    args.gateways, bindings(args), args.load_reports, queued_modes(args)):
                model = FleetModel(n, args.kv_capacity_tokens, args.eviction_policy,
                                   prefill_us_per_token=args.prefill_us_per_token,
                                   decode_ms_per_token=1.0, schedule=args.schedule,
                                   load_reports=reports == "on", announcements=queued != "off",
                                   announce_at=at)
                o = simulate(requests, model, "cache_aware", gateways=g, seed=args.seed,
                             gateway_config=config)
                lat = [x * 1e3 for x in o.latencies]
                steady = [x * 1e3 for x in o.steady_latencies()]
                busy = o.busy_time or 1.0
                print(f"{n:>3} {workload:<13} {g:>8}{late:<6} {reports:>4} {queued:>6} "
                      f"{o.hit_rate:6.3f} "
                      f"{percentile(lat, 0.5):7.1f} {percentile(lat, 0.99):7.1f} "
                      f"{percentile(steady, 0.99):5.1f} "
                      f"{o.idle_while_queued / busy:6.1%} {o.idle_avoidable / busy:7.1%}  "
                      f"{min(o.per_worker)}/{max(o.per_worker)}", flush=True)


def queued_modes(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(the queued column, FleetModel.announce_at) of each --announcements x --announce-at run:
    the fifo workers announce after a fixed delay, so --announce-at means nothing to them."""
    modes = []
    for announce in args.announcements:
        if announce == "off" or args.schedule == "fifo":
            modes.append((announce, "intake"))
        else:
            modes += [(at, at) for at in args.announce_at]
    return modes


# --- overhead -------------------------------------------------------------------------------------
def overhead(args: argparse.Namespace) -> None:
    fleet, urls = spawn_fleet(1, args, zero=True)
    worker_port = int(urls[0].rsplit(":", 1)[1])
    gateway, port = spawn_gateway(urls, "cache_aware")
    plain = json.dumps({"model": "sim-model", "prompt": words(0, 32), "max_tokens": 1}).encode()
    streamed = json.dumps({"model": "sim-model", "prompt": words(0, 32), "max_tokens": 1,
                           "stream": True}).encode()
    streamed8 = json.dumps({"model": "sim-model", "prompt": words(0, 32), "max_tokens": 8,
                            "stream": True}).encode()
    try:
        def side_by_side(body: bytes, rounds: int) -> list[list[Sample]]:
            return asyncio.run(interleaved([worker_port, port], "/v1/completions", body, rounds))

        side_by_side(plain, 300)  # warm up both paths
        direct, via = side_by_side(plain, args.sequential)
        direct_s, via_s = side_by_side(streamed, args.sequential)
        cpu0 = cpu_seconds(gateway.pid)
        samples, elapsed = asyncio.run(closed_loop(
            port, lambda i: ("/v1/completions", plain), args.concurrency, None, args.seconds))
        cpu = cpu_seconds(gateway.pid) - cpu0
        cpu0 = cpu_seconds(gateway.pid)
        streams, stream_elapsed = asyncio.run(closed_loop(
            port, lambda i: ("/v1/completions", streamed8), args.concurrency, None,
            args.seconds))
        stream_cpu = cpu_seconds(gateway.pid) - cpu0
    finally:
        stop(gateway)
        stop(fleet)
    added = (statistics.median(s.latency for s in via)
             - statistics.median(s.latency for s in direct)) * 1e6
    added_ttfb = (statistics.median(s.ttft for s in via_s)
                  - statistics.median(s.ttft for s in direct_s)) * 1e6
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# gateway overhead, zero-service-time simulated worker, 32-token prompts, "
          f"{os.cpu_count()} CPUs, load average at the end {load}")
    print(f"non-streamed p50: direct {statistics.median(s.latency for s in direct) * 1e6:.0f} us,"
          f" via gateway {statistics.median(s.latency for s in via) * 1e6:.0f} us, "
          f"added {added:.0f} us (target < 500)")
    print(f"stream first byte p50: direct {statistics.median(s.ttft for s in direct_s) * 1e6:.0f}"
          f" us, via gateway {statistics.median(s.ttft for s in via_s) * 1e6:.0f} us, "
          f"added {added_ttfb:.0f} us (target < 1000)")
    print(f"throughput: {len(samples) / elapsed:.0f} req/s at concurrency {args.concurrency} "
          f"(target >= 2000); gateway CPU {cpu / len(samples) * 1e6:.0f} us/request "
          f"(target < 300); p50 latency {pct([s.latency for s in samples], 0.5) * 1e3:.2f} ms")
    print(f"streams of 8 tokens (10 SSE events): {len(streams) / stream_elapsed:.0f} req/s, "
          f"gateway CPU {stream_cpu / len(streams) * 1e6:.0f} us/request")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    q = sub.add_parser("quality", help="routing quality across fleets, workloads and policies")
    q.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16])
    q.add_argument("--workloads", nargs="+",
                   default=["capacity-bound", "shared-prefix", "multi-turn", "random"],
                   choices=["capacity-bound", "shared-prefix", "common-prefix", "multi-turn",
                            "random"])
    q.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    q.add_argument("--requests-per-worker", type=int, default=40)
    q.add_argument("--concurrency-per-worker", type=int, default=2)
    q.add_argument("--prefill-us-per-token", type=float, default=100.0)
    q.add_argument("--decode-ms-per-token", type=float, default=1.0)
    q.add_argument("--max-tokens", type=int, default=8)
    q.add_argument("--kv-capacity-tokens", type=int, default=8192)
    q.add_argument("--eviction-policy", default="lru", choices=BENCH_EVICTION_POLICIES,
                   help="the simulated workers' radix cache eviction (HTTP workloads)")
    q.add_argument("--eviction-policies", nargs="+", default=list(BENCH_EVICTION_POLICIES),
                   choices=BENCH_EVICTION_POLICIES, help="capacity-bound: one table per policy")
    q.add_argument("--capacity-requests", type=int, default=4096, help="at most 4096")
    q.add_argument("--capacity-rate", type=float, default=6.0, help="requests/s per worker")
    q.add_argument("--capacity-hot-share", type=float, default=0.0,
                   help="share of the requests that go to one hot group (0: uniform)")
    q.add_argument("--capacity-kv-tokens", type=int, default=131072)
    q.add_argument("--capacity-prefill-us", type=float, default=20.0)
    q.add_argument("--capacity-decode-ms", type=float, default=5.0)
    q.add_argument("--capacity-schedules", nargs="+", default=["fifo"], choices=SCHEDULES,
                   help="how the simulated workers order prefill: fifo (issue 18's workload: one "
                   "at a time, in arrival order) and/or engine (the engine's chunked steps, "
                   "longest cached prefix first)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--binding", nargs="+", default=["early", "late"], choices=["early", "late"],
                   help="capacity-bound: cache_aware rows with early and/or late binding "
                        "(+late: the gateway's wait queue, --late-binding)")
    q.add_argument("--hold-queued-tokens", type=int, default=GatewayConfig.hold_queued_tokens)
    q.add_argument("--gateway-src", metavar="DIR",
                   help="run the gateway from this source checkout (e.g. the previous commit, "
                        "for before/after figures on the same simulated workers)")
    q.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="extra gateway flag, repeatable (--gateway-arg=--balance-abs-threshold=4)")
    q.add_argument("--omit-cached-tokens", action="store_true",
                   help="simulated workers answer without cached_tokens (bench/sim_no_cached.py)")
    m = sub.add_parser("gateways", help="fleet hit rate with 1, 2, 3 gateways (virtual time)")
    m.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    m.add_argument("--gateways", type=int, nargs="+", default=[1, 2, 3])
    m.add_argument("--requests-per-worker", type=int, default=400)
    m.add_argument("--rate", type=float, default=10.0, help="requests/s per worker (Poisson)")
    m.add_argument("--prefill-us-per-token", type=float, default=100.0)
    m.add_argument("--kv-capacity-tokens", type=int, default=8192)
    m.add_argument("--eviction-policy", default="lru", choices=BENCH_EVICTION_POLICIES)
    m.add_argument("--schedule", default="fifo", choices=SCHEDULES,
                   help="how the simulated workers order prefill (see quality's "
                   "--capacity-schedules)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--binding", nargs="+", default=["early", "late"], choices=["early", "late"])
    m.add_argument("--hold-queued-tokens", type=int, default=GatewayConfig.hold_queued_tokens)
    m.add_argument("--load-reports", nargs="+", default=["on"], choices=["on", "off"],
                   help="whether the workers' KV streams say their load (ours do; off: each "
                   "gateway knows only the requests it sent)")
    m.add_argument("--announcements", nargs="+", default=["on"], choices=["on", "off"],
                   help="whether the workers' KV streams name each prompt they queue (ours do; "
                   "off: a gateway learns where another sent a prompt when its prefill ends)")
    m.add_argument("--announce-at", nargs="+", default=["intake"], choices=ANNOUNCE_AT,
                   help="engine schedule: a queued event leaves when the core takes the request "
                   "in (intake, ours) or with the output of the step after that (step, ours "
                   "before)")
    o = sub.add_parser("overhead", help="what the gateway adds, with zero-time workers")
    o.add_argument("--sequential", type=int, default=2000)
    o.add_argument("--concurrency", type=int, default=32)
    o.add_argument("--seconds", type=float, default=5.0)
    o.add_argument("--kv-capacity-tokens", type=int, default=65536)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally blocks: stop children
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    {"quality": quality, "gateways": gateways, "overhead": overhead}[args.mode](args)


if __name__ == "__main__":
    main()
