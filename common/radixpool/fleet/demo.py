"""`radixpool demo`: the same traffic through the same local fleet, routed two ways.

One fleet is started once; for each policy the workers' caches are flushed and a fresh gateway
with that policy takes the port, then a fixed pool of clients plays the workload (shared-prefix
questions and multi-turn conversations, see `workload.py`). Each worker's KV pool is sized to
hold about its share of the working set, as on a busy real fleet: routing that keeps each prefix
on one worker keeps it cached; spreading every prefix over every worker makes them evict each
other.
"""

from __future__ import annotations

import queue
import sys
import threading
import time

import httpx

from radixpool.fleet.client import ChatResult, stream_chat
from radixpool.fleet.fleet import FleetSpec, LocalFleet
from radixpool.fleet.process import ChildFailed
from radixpool.fleet.progress import StatusLine, bar, readiness_text
from radixpool.fleet.report import RunSummary, format_table, summarize, verdict
from radixpool.fleet.up import resolve_model
from radixpool.fleet.workload import Job, WorkloadShape, demo_jobs

POLICIES = ("cache_aware", "round_robin")
WORKERS = 3
CLIENTS = 6
KV_TOKENS_PER_WORKER = 8192
QUICK_SHAPE = WorkloadShape(groups=4, questions=3, conversations=2, turns=2)
REQUEST_TIMEOUT_S = 120.0


def run_jobs(gateway_url: str, model: str, jobs: list[Job], clients: int,
             on_result=None) -> list[tuple[str, ChatResult]]:
    """Play `jobs` with `clients` concurrent sessions; a conversation's turns go one after
    another, each carrying the history and the model's previous answers."""
    todo: queue.Queue[Job] = queue.Queue()
    for job in jobs:
        todo.put(job)
    results: list[tuple[str, ChatResult]] = []
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=gateway_url, timeout=REQUEST_TIMEOUT_S) as http:
            while True:
                try:
                    job = todo.get_nowait()
                except queue.Empty:
                    return
                messages = [{"role": "system", "content": job.system}]
                for turn in job.turns:
                    messages.append({"role": "user", "content": turn})
                    result = stream_chat(http, model, messages, job.max_tokens)
                    with lock:
                        results.append((job.kind, result))
                        if on_result is not None:
                            on_result(len(results))
                    if not result.ok:
                        break
                    messages.append({"role": "assistant", "content": result.text})

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _gateway_predicted_hit_rate(fleet: LocalFleet) -> float | None:
    """What the gateway's trees predicted; None when its policy predicts nothing."""
    if fleet.gateway_policy != "cache_aware":
        return None
    try:
        doc = httpx.get(fleet.gateway.url + "/workers", timeout=5.0).json()
        return float(doc["fleet"]["predicted_hit_rate"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def _warm_up(fleet: LocalFleet, model: str) -> None:
    """One short request per worker, so first-call costs do not land in the first policy's
    numbers (`run_policy` empties the caches before each run)."""
    for w in fleet.workers:
        with httpx.Client(base_url=w.url, timeout=REQUEST_TIMEOUT_S) as http:
            stream_chat(http, model, [{"role": "user", "content": "warm up"}], 4)


def run_policy(fleet: LocalFleet, policy: str, jobs: list[Job], total: int,
               status: StatusLine) -> RunSummary:
    for i in range(len(fleet.workers)):
        fleet.flush_worker(i)
    fleet.restart_gateway(policy)  # fresh counters, and the policy under test
    started = time.perf_counter()

    def progress(done: int) -> None:
        elapsed = time.perf_counter() - started
        status.show(bar(f"{policy:>12}", done, total, f"{elapsed:.0f} s"))

    results = run_jobs(fleet.gateway.url, fleet.spec.model_name, jobs, CLIENTS, progress)
    wall = time.perf_counter() - started
    status.show(bar(f"{policy:>12}", len(results), total, f"{wall:.0f} s"), final=True)
    return summarize(policy, results, wall, _gateway_predicted_hit_rate(fleet),
                     fleet.worker_urls)


def run_demo(model: str | None = None, workers: int | None = None, quick: bool = False) -> int:
    started = time.perf_counter()
    shape = QUICK_SHAPE if quick else WorkloadShape()
    jobs = demo_jobs(shape)
    try:
        model_dir, builtin_name = resolve_model(model)
        spec = FleetSpec(model=model_dir, workers=workers or WORKERS, port=0,
                         policy=POLICIES[0], served_model_name=builtin_name,
                         kv_cache_tokens=KV_TOKENS_PER_WORKER)
    except ValueError as exc:
        print(f"radixpool demo: {exc}", file=sys.stderr)
        return 2
    status = StatusLine()
    print(f"radixpool demo: {spec.workers} workers (KV cache {KV_TOKENS_PER_WORKER} tokens each) "
          f"behind one gateway; {shape.requests} requests per policy from {CLIENTS} clients: "
          f"{shape.groups} system prompts x {shape.questions} questions, "
          f"{shape.conversations} conversations x {shape.turns} turns.", file=sys.stderr)
    fleet = LocalFleet(spec)
    try:
        fleet.start(lambda r: status.show(readiness_text(r), final=r.gateway_ready))
        _warm_up(fleet, spec.model_name)
        runs = [run_policy(fleet, policy, jobs, shape.requests, status) for policy in POLICIES]
    except ChildFailed as exc:
        status.done()
        print(f"radixpool demo: {exc}", file=sys.stderr)
        return 1
    finally:
        fleet.stop()
    print()
    print(format_table(runs))
    print()
    print(verdict(runs[0], runs[1]))
    print(f"(whole demo: {time.perf_counter() - started:.0f} s, including starting and stopping "
          f"the fleet)")
    print("Serve your own traffic: `radixpool up` prints an OpenAI base URL (docs/local-fleet.md).")
    for r in runs:
        if r.failed:
            print(f"radixpool demo: {r.failed} request(s) failed under {r.policy}; the first: "
                  f"{r.first_error}", file=sys.stderr)
    return 1 if any(r.failed for r in runs) else 0

