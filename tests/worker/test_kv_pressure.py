"""The engine under KV pressure: pages are the one unit, a tight pool never crashes or livelocks,
and a double free never hands a slot out twice."""

from __future__ import annotations

import pytest
import torch
from kv_driver import Outcome, collect, expected_output, make_scheduler, run_all

from radixpool.worker.mem.kv_pool import KVDoubleFree, KVPool
from radixpool.worker.request import Req
from radixpool.worker.sampling_params import SamplingParams


def submit(sched, outcomes, rid: str, prompt: list[int], max_new: int, **params) -> None:
    p = SamplingParams(max_new_tokens=max_new, **params)
    delta = sched.add(Req(rid, prompt, p, 0))
    if delta is not None:
        collect(outcomes, [delta])


def assert_complete(outcomes: dict[str, Outcome], prompts: dict[str, list[int]], max_new: int):
    for rid, prompt in prompts.items():
        want, reason = expected_output(prompt, max_new)
        assert outcomes[rid].error is None, outcomes[rid]
        assert (outcomes[rid].tokens, outcomes[rid].finish_reason) == (want, reason), rid


def test_decode_crossing_a_page_boundary_in_a_tight_pool():
    # Four pages of 16; three 16-token prompts fill three, and every first decode token needs
    # a fresh page: counting free *tokens* (16 >= 3) said yes, the pages were not there.
    sched, model = make_scheduler(16, 64)
    outcomes: dict[str, Outcome] = {}
    prompts = {f"r{i}": [100 + 17 * i + j for j in range(16)] for i in range(3)}
    for rid, prompt in prompts.items():
        submit(sched, outcomes, rid, prompt, 4)
    run_all(sched, model, outcomes)
    assert_complete(outcomes, prompts, 4)


def test_many_short_prompts_into_few_pages():
    # Eight 3-token prompts fit four 16-token pages by token count, not by pages.
    sched, model = make_scheduler(16, 64)
    outcomes: dict[str, Outcome] = {}
    prompts = {f"r{i}": [200 + 5 * i, 201 + 5 * i, 202 + 5 * i] for i in range(8)}
    for rid, prompt in prompts.items():
        submit(sched, outcomes, rid, prompt, 4)
    run_all(sched, model, outcomes)
    assert_complete(outcomes, prompts, 4)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_long_chunked_prompt_in_a_tight_pool_progresses(page_size):
    # The next chunk was checked against a budget that already held back the request's own
    # decode reservation (half its 200 new tokens): nothing was scheduled, forever.
    sched, model = make_scheduler(page_size, 64, chunk=16, max_prefill=16)
    outcomes: dict[str, Outcome] = {}
    prompt = [300 + i for i in range(40)]
    submit(sched, outcomes, "long", prompt, 200)
    run_all(sched, model, outcomes)
    got = outcomes["long"]
    want, _ = expected_output(prompt, 200)
    # Alone in 64 slots it can grow to 64 tokens, then it has outgrown this worker's KV.
    assert got.finish_reason == "length" and got.error is None
    assert got.tokens == want[:len(got.tokens)] and len(prompt) + len(got.tokens) >= 64


def test_a_prompt_that_can_never_fit_is_refused_with_a_clear_error():
    sched, _ = make_scheduler(16, 64)
    outcomes: dict[str, Outcome] = {}
    submit(sched, outcomes, "big", list(range(5, 70)), 4)
    assert outcomes["big"].finish_reason == "abort"
    assert "65 tokens" in outcomes["big"].error
    assert not sched.has_work


def test_a_chunked_prompt_next_to_decoding_requests_in_a_tight_pool():
    sched, model = make_scheduler(4, 96, chunk=8, max_prefill=12)
    outcomes: dict[str, Outcome] = {}
    prompts = {"a": [400 + i for i in range(10)], "b": [500 + i for i in range(12)],
               "long": [600 + i for i in range(50)]}
    for rid, prompt in prompts.items():
        submit(sched, outcomes, rid, prompt, 30)
    run_all(sched, model, outcomes)
    assert_complete(outcomes, prompts, 30)


def make_pool(page_size: int = 1, debug: bool = False) -> KVPool:
    return KVPool(64, page_size, 1, 1, 1, torch.float32, "cpu", debug=debug)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_double_free_never_hands_a_slot_out_twice(page_size):
    # Before: the freed pages sat twice on the free stack and went to two owners.
    pool = make_pool(page_size)
    kept = pool.alloc(16)
    slots = pool.alloc(8)
    pool.free(slots)
    pool.free(slots)                       # production: counted and ignored
    assert pool.double_frees == 8 // page_size
    rest = pool.alloc(pool.capacity - 16)
    assert rest is not None and pool.alloc(1) is None
    handed_out = kept.tolist() + rest.tolist()
    assert len(set(handed_out)) == len(handed_out) == pool.capacity


def test_a_slot_listed_twice_in_one_free_is_freed_once():
    pool = make_pool(1)
    slots = pool.alloc(4)
    pool.free(slots[:1].repeat(2))
    assert pool.double_frees == 1 and pool.available_size() == pool.capacity - 3


def test_a_double_free_raises_in_debug_mode():
    pool = make_pool(4, debug=True)
    slots = pool.alloc(8)
    pool.free(slots)
    with pytest.raises(KVDoubleFree, match="already free"):
        pool.free(slots[4:])
    assert pool.available_size() == pool.capacity


def test_the_engine_counts_double_frees_and_raises_in_debug(tiny_model):
    from radixpool.worker.config import EngineConfig
    from radixpool.worker.engine_core import EngineCore

    core = EngineCore(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=256))
    pool = core.runner.kv_pool
    slots = pool.alloc(3)
    pool.free(slots)
    pool.free(slots)
    assert core.stats().kv_double_frees_total == 3
    core = EngineCore(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=256,
                                   debug_invariants=True))
    slots = core.runner.kv_pool.alloc(3)
    core.runner.kv_pool.free(slots)
    with pytest.raises(KVDoubleFree):
        core.runner.kv_pool.free(slots)


def test_page_size_16_in_a_tight_pool_on_the_tiny_model(tiny_model):
    """The shipped example runs pageSize 16: with a pool of a few pages, many requests crossing
    page boundaries give the same greedy tokens as with plenty of KV (it used to crash)."""
    import random

    from radixpool.worker.config import EngineConfig
    from radixpool.worker.engine_core import EngineCore
    from radixpool.worker.messages import GenerateRequest

    rng = random.Random(3)
    prompts = [[rng.randrange(5, 1000) for _ in range(rng.randint(2, 40))] for _ in range(8)]
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)

    def run(**kv) -> list[list[int]]:
        core = EngineCore(EngineConfig(str(tiny_model), device="cpu", chunked_prefill_size=16,
                                       max_prefill_tokens=32, debug_invariants=True, **kv))
        for i, ids in enumerate(prompts):
            assert core.add_request(GenerateRequest(f"r{i}", ids, params, 0)) is None
        out = {f"r{i}": [] for i in range(len(prompts))}
        while core.has_work:
            for delta in core.step().deltas:
                assert delta.error is None, delta.error
                out[delta.rid] += delta.token_ids
        core.check_invariants()
        return [out[f"r{i}"] for i in range(len(prompts))], core.scheduler.retracted_total

    roomy, _ = run(kv_cache_tokens=8192)
    tight, retracted = run(kv_cache_tokens=96, page_size=16)
    assert tight == roomy and retracted > 0


@pytest.mark.parametrize("jump_forward", ["exact", "retokenize"])
def test_forced_text_that_outgrows_the_pool_ends_with_length(tiny_model, jump_forward):
    """A request alone whose text forced by its grammar (jump-forward) no longer fits the KV pool
    ended with "the request needs more KV than this worker has" (a 500 on the HTTP API), where
    decoding token by token it ends with "length" once it outgrows the pool."""
    from radixpool.tokenization import PromptTokenizer
    from radixpool.worker.config import EngineConfig
    from radixpool.worker.engine_core import EngineCore
    from radixpool.worker.messages import GenerateRequest

    literal = "the quick brown fox jumps over the lazy dog " * 8
    prompt = [5 + (i * 13) % 900 for i in range(200)]
    params = SamplingParams(max_new_tokens=150, temperature=0, ebnf=f'root ::= "{literal}"')
    core = EngineCore(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=320,
                                   page_size=16, chunked_prefill_size=17, max_prefill_tokens=40,
                                   jump_forward=jump_forward, debug_invariants=True))
    assert core.add_request(GenerateRequest("r", prompt, params, 0)) is None
    tokens, last = [], None
    while core.has_work:
        for delta in core.step().deltas:
            tokens += delta.token_ids
            last = delta
    assert last.error is None and last.finish_reason == "length" and tokens
    assert literal.startswith(PromptTokenizer.from_dir(tiny_model).decode(tokens))
    core.check_invariants()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_that_outgrows_the_pool_releases_its_penalty_counts(tiny_model, overlap):
    """A finish the scheduler decides itself (the request outgrew the KV pool) arrives outside
    a processed batch: the sampler must forget the request's penalty counts there too, as for
    every other finish. Nothing a client sees changed (the table is LRU-bounded and a reused
    request id is recounted), so this checks the release through the sampler's public
    `release`."""
    from radixpool.worker.config import EngineConfig
    from radixpool.worker.engine_core import EngineCore
    from radixpool.worker.messages import GenerateRequest

    core = EngineCore(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=64,
                                   overlap_schedule=overlap, debug_invariants=True))
    released: list[str] = []
    release = core.sampler.release
    core.sampler.release = lambda rid: (released.append(rid), release(rid))
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True,
                            repetition_penalty=1.3, frequency_penalty=0.5)
    assert core.add_request(GenerateRequest("r", list(range(5, 65)), params, 0)) is None
    last = None
    while core.has_work:
        for delta in core.step().deltas:
            last = delta
    assert last.finish_reason == "length" and last.error is None
    assert released == ["r"]
    core.check_invariants()
