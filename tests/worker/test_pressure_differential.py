"""Differential oracle under memory pressure: every request gets the tokens it gets alone in a roomy
engine, whatever the pool size, page size, chunk size, batch, cache hits, retractions and aborts.

One workload (shared prefixes cut mid-page, identical prompts, seeded sampling forks, penalties,
a grammar, stop tokens, requests arriving late, aborts mid-prefill and mid-decode with the rid
reused at once) runs in engines whose pool barely holds the longest request, with chunks that are
not a multiple of the page, under each eviction policy and FCFS too. The reference is each
request alone, with plenty of KV, whole-prompt prefill and token-by-token grammar decoding. A
request that outgrew the pool ends with "length" and a prefix of its reference; usage counts and
the invariant checker are checked too, and after a flush every KV page is free.
"""

from __future__ import annotations

import random

import pytest

from radixpool.worker.config import EngineConfig
from radixpool.worker.engine_core import EngineCore
from radixpool.worker.messages import GenerateRequest
from radixpool.worker.sampler import request_seed
from radixpool.worker.sampling_params import SamplingParams

GRAMMAR = 'root ::= "the quick brown fox jumps" (" over" | " under") " the lazy dog"'


def workload(seed: int) -> list[tuple[str, list[int], SamplingParams, int, int]]:
    """(rid, prompt, params, sampling seed, arrival step) per request."""
    rng = random.Random(seed)
    stems = [[rng.randrange(5, 1000) for _ in range(rng.randint(20, 60))] for _ in range(2)]
    reqs = []
    for i in range(9):
        if i % 3 == 2:
            prompt = list(reqs[-1][1])                       # an identical prompt
        else:
            prompt = rng.choice(stems)[:rng.randint(5, 60)] + \
                [rng.randrange(5, 1000) for _ in range(rng.randint(1, 12))]
        extra: dict = {}
        if i == 4:
            extra["ebnf"] = GRAMMAR
        if i == 5:
            extra.update(frequency_penalty=0.7, repetition_penalty=1.3)
        if i == 6:
            extra["stop_token_ids"] = tuple(rng.sample(range(5, 1000), 60))
        params = SamplingParams(max_new_tokens=rng.randint(8, 40),
                                temperature=0.9 if i in (1, 7) else 0, top_k=20,
                                ignore_eos=i != 8, **extra)
        forks = 2 if i in (1, 7) else 1                      # n = 2, as the front end fans out
        for fork in range(forks):
            reqs.append((f"q{i}-{fork}", prompt, params, request_seed(1000 + i, fork),
                         0 if i < 6 else rng.randint(1, 12)))
    return reqs


def alone(model: str, prompt: list[int], params: SamplingParams, seed: int) -> tuple[list, str]:
    core = EngineCore(EngineConfig(model, device="cpu", kv_cache_tokens=4096, jump_forward="off"))
    assert core.add_request(GenerateRequest("ref", prompt, params, seed)) is None
    tokens, reason = [], None
    while core.has_work:
        for delta in core.step().deltas:
            tokens += delta.token_ids
            reason = delta.finish_reason if delta.finished else reason
    return tokens, reason


def run_pressed(core: EngineCore, reqs, aborts: dict[str, int]) -> dict[str, dict]:
    """Run the workload; an aborted request is resubmitted under its rid at once."""
    out: dict[str, dict] = {}
    pending = sorted(reqs, key=lambda r: r[4])
    by_rid = {r[0]: r for r in reqs}

    def submit(rid: str) -> None:
        _, prompt, params, seed, _ = by_rid[rid]
        assert core.add_request(GenerateRequest(rid, prompt, params, seed)) is None
        out[rid] = {"tokens": [], "reason": None}

    step = 0
    while pending or core.has_work:
        while pending and pending[0][4] <= step:
            submit(pending.pop(0)[0])
        for rid, at in aborts.items():
            if at == step and rid in out and out[rid]["reason"] is None:
                delta = core.abort(rid)
                assert delta is not None and delta.finish_reason == "abort"
                submit(rid)
        for delta in core.step().deltas:
            got = out[delta.rid]
            assert got["reason"] is None, f"{delta.rid}: output after its end"
            assert delta.error is None, delta.error
            got["tokens"] += delta.token_ids
            if delta.finished:
                got.update(reason=delta.finish_reason, prompt=delta.prompt_tokens,
                           cached=delta.cached_tokens)
        if core.has_work:
            core.check_invariants()
        step += 1
        assert step < 3000, "no progress"
    return out


@pytest.mark.parametrize("page_size,chunk,slack,overlap,seed,eviction,schedule", [
    (16, 17, 16, False, 0, "lru", "lpm"),
    (16, 33, 32, True, 1, "probation", "fcfs"),
    (1, 17, 2, True, 2, "lfu", "lpm"),
    (1, 33, 40, False, 3, "probation", "lpm"),
])
def test_tight_pool_gives_every_request_its_tokens_alone(tiny_model, page_size, chunk, slack,
                                                         overlap, seed, eviction, schedule):
    model = str(tiny_model)
    reqs = workload(seed)
    longest = max(len(prompt) + p.max_new_tokens for _, prompt, p, _, _ in reqs)
    core = EngineCore(EngineConfig(
        model, device="cpu", kv_cache_tokens=longest + slack, page_size=page_size,
        chunked_prefill_size=chunk, max_prefill_tokens=2 * chunk, overlap_schedule=overlap,
        eviction_policy=eviction, schedule_policy=schedule,
        max_queue_wait_s=1e-6, debug_invariants=True))   # (the starvation path too)
    rng = random.Random(seed)
    aborts = {rid: rng.randint(0, 8) for rid, *_ in rng.sample(reqs, 3)}
    out = run_pressed(core, reqs, aborts)

    for rid, prompt, params, s, _ in reqs:
        got, (want, reason) = out[rid], alone(model, prompt, params, s)
        assert got["prompt"] == len(prompt), rid
        assert 0 <= got["cached"] < len(prompt), rid
        if got["reason"] == "length" and len(got["tokens"]) < len(want):
            # outgrew the pool: only when its sequence could not fit alone
            assert got["tokens"] == want[:len(got["tokens"])], rid
            assert len(prompt) + len(got["tokens"]) > core.runner.kv_pool.capacity, rid
        else:
            assert (got["tokens"], got["reason"]) == (want, reason), rid
    assert core.scheduler.retracted_total > 0, "the workload was meant to retract"
    core.flush_cache()
    pool = core.runner.kv_pool
    assert pool.available_size() == pool.capacity
