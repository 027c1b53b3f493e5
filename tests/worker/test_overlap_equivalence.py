"""The overlapped loop (step N+1 scheduled before step N's tokens reach the host) gives
token-for-token what the synchronous loop gives, on the tiny models: random workloads with shared
prefixes, sampling with seeds (n > 1 forks), stop tokens, penalties (which make the overlapped
loop process first), KV so tight that requests are retracted, aborts, and stop strings."""

from __future__ import annotations

import random

import pytest

from radixpool.worker.config import EngineConfig
from radixpool.worker.engine_core import EngineCore
from radixpool.worker.messages import GenerateRequest
from radixpool.worker.sampler import request_seed
from radixpool.worker.sampling_params import SamplingParams


def workload(seed: int) -> tuple[list[tuple[str, list[int], SamplingParams, int]], dict]:
    rng = random.Random(seed)
    stems = [[rng.randrange(5, 1000) for _ in range(rng.randint(8, 60))] for _ in range(3)]
    reqs, aborts = [], {}
    for i in range(rng.randint(6, 12)):
        prompt = rng.choice(stems)[:rng.randint(0, 60)] + \
            [rng.randrange(5, 1000) for _ in range(rng.randint(1, 20))]
        params = dict(max_new_tokens=rng.randint(1, 16), temperature=rng.choice([0, 0, 0.8]),
                      top_p=rng.choice([1.0, 0.9]), ignore_eos=rng.random() < 0.5,
                      stop_token_ids=tuple(rng.sample(range(5, 1000), 30)) if rng.random() < 0.3
                      else (),
                      min_new_tokens=rng.choice([0, 0, 2]))
        if rng.random() < 0.2:
            params["frequency_penalty"] = 0.5
        params["min_new_tokens"] = min(params["min_new_tokens"], params["max_new_tokens"])
        forks = rng.choice([1, 1, 2, 3])
        base_seed = rng.randrange(1 << 30)
        for fork in range(forks):   # n > 1: one core request per choice, as the front end does
            rid = f"q{i}-{fork}"
            reqs.append((rid, prompt, SamplingParams(**params), request_seed(base_seed, fork)))
            if rng.random() < 0.1:
                aborts[rid] = rng.randint(0, 12)
    return reqs, aborts


def run(model: str, overlap: bool, seed: int, page_size: int, kv_tokens: int) -> tuple:
    core = EngineCore(EngineConfig(model, device="cpu", kv_cache_tokens=kv_tokens,
                                   page_size=page_size, chunked_prefill_size=16,
                                   max_prefill_tokens=48, overlap_schedule=overlap,
                                   debug_invariants=True))
    reqs, aborts = workload(seed)
    out: dict[str, list] = {rid: [[], None] for rid, *_ in reqs}
    for rid, ids, params, s in reqs:
        assert core.add_request(GenerateRequest(rid, ids, params, s)) is None
    step = 0
    while core.has_work:
        for rid, at in aborts.items():
            if at == step:
                delta = core.abort(rid)
                if delta is not None:
                    out[rid][1] = "abort"
        for delta in core.step().deltas:
            out[delta.rid][0] += delta.token_ids
            if delta.finished:
                out[delta.rid][1] = delta.finish_reason
        step += 1
        core.check_invariants()
    return out, core.scheduler.retracted_total


@pytest.mark.parametrize("seed,page_size,kv_tokens", [(0, 1, 160), (1, 4, 192), (2, 1, 4096),
                                                      (3, 16, 256)])
def test_overlapped_loop_gives_the_same_tokens(tiny_model, seed, page_size, kv_tokens):
    sync, retracted = run(str(tiny_model), False, seed, page_size, kv_tokens)
    overlapped, _ = run(str(tiny_model), True, seed, page_size, kv_tokens)
    assert sync.keys() == overlapped.keys()
    for rid in sync:
        (a, ra), (b, rb) = sync[rid], overlapped[rid]
        if "abort" in (ra, rb):
            # aborted at the same step, the overlapped loop may have one step less or more
            shorter, longer = sorted((a, b), key=len)
            assert longer[:len(shorter)] == shorter, rid
        else:
            assert (a, ra) == (b, rb), rid
    if kv_tokens < 300 and page_size == 1:
        assert retracted > 0, "the workload was meant to retract"


def test_overlapped_engine_with_stop_strings_and_n(tiny_model):
    from radixpool.worker.engine import Engine

    prompts = ["the quick brown fox", "a b c d e f g", "the quick brown fox jumps"]
    params = {"max_new_tokens": 12, "temperature": 0.7, "seed": 11, "n": 3,
              "stop": ["e", " t"]}
    results = []
    for overlap in (False, True):
        with Engine(str(tiny_model), device="cpu", kv_cache_tokens=512,
                    overlap_schedule=overlap) as engine:
            results.append(engine.generate(prompts, [params] * len(prompts)))
    sync, overlapped = results
    assert [(r["text"], r["output_ids"], r["meta_info"]["finish_reason"]) for r in sync] == \
        [(r["text"], r["output_ids"], r["meta_info"]["finish_reason"]) for r in overlapped]
    assert any(r["meta_info"]["finish_reason"] == "stop" for r in sync), "no stop string hit"


@pytest.mark.parametrize("overlap", [False, True])
def test_the_token_read_is_timed_apart_from_host_work(tiny_model, overlap):
    """`StepTimes.wait` is the time blocked reading sampled tokens (on a GPU, the wait for the
    device), part of `process`: benchmarks subtract it to get the host's own work."""
    core = EngineCore(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=2048,
                                   overlap_schedule=overlap))
    core.add_request(GenerateRequest("r", [1, 40, 41, 42], SamplingParams(
        max_new_tokens=6, temperature=0, ignore_eos=True), seed=0))
    while core.has_work:
        core.step()
    t = core.times
    assert t.steps >= 6 and 0 < t.wait <= t.process
