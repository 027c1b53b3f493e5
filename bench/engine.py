"""Offline engine benchmark: throughput, cache hit rate, and the CPU cost of bookkeeping.

    python bench/engine.py offline  [--model DIR] [--requests 256] [--prompt-len 256]
                                    [--output-len 64] [--shared-prefix 0.5] [--groups 8]
    python bench/engine.py bookkeeping [--batch 64 256] [--tree-tokens 1000000] [--prompt-len 4096]
    python bench/engine.py queue [--waiting 8000] [--prefix-len 4096] [--chunk 512]

`offline` runs the engine core in-process (no HTTP, no IPC) on a workload where a fraction
(`--shared-prefix`) of each prompt is a prefix shared by its group, and prints generated tokens/s,
the cache hit rate, and the wall time per step split into scheduling + cache bookkeeping, model
forward, and sampling. On a GPU the bookkeeping is what caps small-model throughput, so it is
reported apart from the model.

`queue` measures a scheduling step with thousands of requests waiting behind one shared prefix
that is still being computed (they cannot be admitted yet: the step must not grow with them).

`bookkeeping` measures the two costs the engine issue names, without a model:
- one decode step's scheduling and result processing at `--batch` running requests
  (the model forward and the sampler replaced by constant outputs), with the synchronous loop and
  with the overlapped one (step N+1 scheduled before step N's results are processed);
- `match_prefix` + `insert` of a `--prompt-len`-token prompt against a tree holding
  `--tree-tokens` tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _model(path: str | None) -> str:
    if path:
        return path
    from radixpool.worker.tiny_model import make_tiny_model

    return str(make_tiny_model(tempfile.mkdtemp(prefix="radixpool-bench-"), "llama", 0))


def offline(args: argparse.Namespace) -> None:
    from radixpool.worker.config import EngineConfig
    from radixpool.worker.engine_core import EngineCore
    from radixpool.worker.messages import GenerateRequest
    from radixpool.worker.sampling_params import SamplingParams

    rng = random.Random(0)
    shared_len = int(args.prompt_len * args.shared_prefix)
    prefixes = [[rng.randrange(5, 1000) for _ in range(shared_len)] for _ in range(args.groups)]
    prompts = [prefixes[i % args.groups] +
               [rng.randrange(5, 1000) for _ in range(args.prompt_len - shared_len)]
               for i in range(args.requests)]
    config = EngineConfig(_model(args.model), device=args.device,
                          kv_cache_tokens=args.kv_cache_tokens,
                          max_running_requests=args.max_running_requests,
                          chunked_prefill_size=args.chunked_prefill_size,
                          max_prefill_tokens=max(args.chunked_prefill_size, 8192),
                          overlap_schedule=args.overlap)
    core = EngineCore(config)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        core.add_request(GenerateRequest(f"r{i}", ids, params, seed=i))
    generated = prompt_tokens = cached = 0
    while core.has_work:
        for delta in core.step().deltas:
            generated += len(delta.token_ids)
            if delta.finished:
                prompt_tokens += delta.prompt_tokens
                cached += delta.cached_tokens
    elapsed = time.perf_counter() - start
    t = core.times
    print(f"device {core.runner.device}, model {core.runner.architecture}, "
          f"{'overlapped' if core.overlap else 'synchronous'} loop, "
          f"{args.requests} requests x ({args.prompt_len} prompt, {args.output_len} output), "
          f"shared prefix {args.shared_prefix:.0%} in {args.groups} groups")
    print(f"  generated tokens/s   {generated / elapsed:10.1f}")
    print(f"  total tokens/s       {(generated + prompt_tokens - cached) / elapsed:10.1f}"
          "   (computed prompt + generated)")
    ideal = shared_len * (args.requests - args.groups) / (args.prompt_len * args.requests)
    print(f"  cache hit rate       {cached / max(prompt_tokens, 1):10.3f}   (ideal {ideal:.3f})")
    print(f"  steps                {t.steps:10d}   wall {elapsed:.2f} s")
    for name in ("schedule", "process", "forward", "sample"):
        print(f"  {name:<20} {1e3 * getattr(t, name) / max(t.steps, 1):10.3f} ms/step")
    print(f"  bookkeeping          {1e3 * t.bookkeeping / max(t.steps, 1):10.3f} ms/step"
          "   (schedule + process: everything but the model and the sampler)")


def _decode_steps(batch: int, steps: int, overlap: bool, rng: random.Random) -> list[float]:
    """Host time per decode step at `batch` running requests, the model replaced by constant
    tokens; overlapped: step N+1 is scheduled before step N's results are processed."""
    import torch

    from radixpool.worker.config import EngineConfig
    from radixpool.worker.mem.kv_pool import KVPool, ReqToTokenPool
    from radixpool.worker.mem.radix_cache import RadixCache
    from radixpool.worker.request import Req
    from radixpool.worker.sampling_params import SamplingParams
    from radixpool.worker.scheduler.scheduler import Scheduler

    prompt = 128
    pool = KVPool(batch * (prompt + steps + 8), 1, 1, 1, 1, torch.float32, "cpu")
    rows = ReqToTokenPool(batch + 4, 4096, "cpu")
    cache = RadixCache(pool, 1, 16)
    config = EngineConfig("unused", max_running_requests=batch, chunked_prefill_size=8192,
                          max_prefill_tokens=batch * prompt + batch)
    sched = Scheduler(config, pool, rows, cache, 4096, (2,))
    params = SamplingParams(max_new_tokens=10_000, ignore_eos=True)
    for i in range(batch):
        sched.add(Req(f"r{i}", [rng.randrange(5, 1000) for _ in range(prompt)], params, i))
    first = sched.next_batch()
    sched.process(first, [7] * sum(first.sample))
    timings, inflight = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        if inflight is not None and not sched.can_schedule_ahead():
            sched.process(inflight, [7] * len(inflight.reqs))
            inflight = None
        step = sched.next_batch()
        if inflight is not None:
            sched.process(inflight, [7] * len(inflight.reqs))
        if overlap:
            inflight = step
        else:
            sched.process(step, [7] * len(step.reqs))
        timings.append(time.perf_counter() - t0)
    return timings


def bookkeeping(args: argparse.Namespace) -> None:
    import torch

    from radixpool.worker.mem.kv_pool import KVPool
    from radixpool.worker.mem.radix_cache import RadixCache

    rng = random.Random(0)
    # --- decode step at batch B: the scheduler and result processing, model stubbed out
    for batch in args.batch:
        for overlap in (False, True):
            timings = _decode_steps(batch, args.decode_steps, overlap, rng)
            print(f"decode step at batch {batch}, {'overlapped ' if overlap else 'synchronous'}"
                  " (scheduler + KV alloc + result processing, no model):")
            print(f"  p50 {1e3 * statistics.median(timings):.3f} ms   "
                  f"p99 {1e3 * sorted(timings)[int(0.99 * len(timings))]:.3f} ms")

    # --- match + insert against a big tree
    total = args.tree_tokens
    pool = KVPool(total + 2 * args.prompt_len, 1, 1, 1, 1, torch.float32, "cpu")
    cache = RadixCache(pool, 1, 16)
    stems = [[rng.randrange(5, 30000) for _ in range(1024)] for _ in range(16)]
    held = 0
    while held < total:
        seq = rng.choice(stems)[:rng.randrange(0, 1024)] + \
            [rng.randrange(5, 30000) for _ in range(args.prompt_len)]
        match = cache.match_prefix(seq)
        new = pool.alloc(len(seq) - match.length)
        slots = torch.cat([match.slots, new])
        present = cache.insert(seq, slots)
        pool.free(slots[match.length:present])
        held = cache.total_size
    times = []
    for _ in range(args.repeats):
        seq = rng.choice(stems)[:512] + [rng.randrange(5, 30000)
                                         for _ in range(args.prompt_len - 512)]
        t0 = time.perf_counter()
        match = cache.match_prefix(seq)
        cache.lock(match.node)
        t1 = time.perf_counter()
        new = pool.alloc(len(seq) - match.length)
        slots = torch.cat([match.slots, new])
        t2 = time.perf_counter()
        present = cache.insert(seq, slots)
        t3 = time.perf_counter()
        pool.free(slots[match.length:present])
        cache.unlock(match.node)
        cache.evict(len(seq))  # keep the tree at its size
        times.append((t1 - t0) + (t3 - t2))
    print(f"match_prefix + insert of a {args.prompt_len}-token prompt (512 cached) against a "
          f"tree of {cache.total_size:,} tokens in {sum(1 for _ in cache.nodes()):,} nodes:")
    print(f"  p50 {1e3 * statistics.median(times):.3f} ms   "
          f"p99 {1e3 * sorted(times)[int(0.99 * len(times))]:.3f} ms "
          "(includes the block hashes of the new blocks for the KV-event stream)")


def queue(args: argparse.Namespace) -> None:
    """Per-step scheduling cost with thousands waiting behind a shared, uncached prefix."""
    import torch

    from radixpool.worker.config import EngineConfig
    from radixpool.worker.mem.kv_pool import KVPool, ReqToTokenPool
    from radixpool.worker.mem.radix_cache import RadixCache
    from radixpool.worker.request import Req
    from radixpool.worker.sampling_params import SamplingParams
    from radixpool.worker.scheduler.scheduler import Scheduler

    rng = random.Random(0)
    prefix = [rng.randrange(5, 30000) for _ in range(args.prefix_len)]
    running = args.max_running
    pool = KVPool(running * (args.prefix_len + 64 + args.steps) + args.prefix_len,
                  1, 1, 1, 1, torch.float32, "cpu")
    rows = ReqToTokenPool(running + 4, args.prefix_len + 64 + args.steps + 8, "cpu")
    cache = RadixCache(pool, 1, 16)
    config = EngineConfig("unused", max_running_requests=running,
                          chunked_prefill_size=args.chunk, max_prefill_tokens=args.chunk)
    sched = Scheduler(config, pool, rows, cache, 1 << 20, (2,))
    params = SamplingParams(max_new_tokens=10_000, ignore_eos=True)
    now = time.time()
    for i in range(args.waiting):
        tail = [rng.randrange(5, 30000) for _ in range(32)]
        sched.add(Req(f"r{i}", prefix + tail, params, i, arrival_time=now))
    timings = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step = sched.next_batch()
        sched.process(step, [7] * sum(step.sample))
        for event in cache.drain_events():   # what EngineCore.step does with the events
            if event.type == "stored":
                sched.waiting.on_stored(event.blocks)
        timings.append(time.perf_counter() - t0)
    timings.sort()
    print(f"{args.waiting} requests sharing an uncached {args.prefix_len}-token prefix "
          f"(chunk {args.chunk}, at most {running} running): {args.steps} steps, "
          f"{len(sched.waiting)} still waiting")
    print(f"  per step (scheduler + result processing + queue updates, no model): "
          f"p50 {1e3 * timings[len(timings) // 2]:.3f} ms   "
          f"p99 {1e3 * timings[int(0.99 * len(timings))]:.3f} ms   max {1e3 * timings[-1]:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("offline")
    p.add_argument("--model")
    p.add_argument("--device", default="auto")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--shared-prefix", type=float, default=0.5)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--kv-cache-tokens", type=int, default=200_000)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--chunked-prefill-size", type=int, default=4096)
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="overlapped scheduling (default: on for CUDA, off on CPU)")
    p.set_defaults(func=offline)
    b = sub.add_parser("bookkeeping")
    b.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    b.add_argument("--decode-steps", type=int, default=200)
    b.add_argument("--tree-tokens", type=int, default=1_000_000)
    b.add_argument("--prompt-len", type=int, default=4096)
    b.add_argument("--repeats", type=int, default=200)
    b.set_defaults(func=bookkeeping)
    q = sub.add_parser("queue")
    q.add_argument("--waiting", type=int, default=8000)
    q.add_argument("--prefix-len", type=int, default=4096)
    q.add_argument("--chunk", type=int, default=512)
    q.add_argument("--max-running", type=int, default=256)
    q.add_argument("--steps", type=int, default=100)
    q.set_defaults(func=queue)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
