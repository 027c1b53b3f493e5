"""Greedy output equals Hugging Face `transformers` for every architecture, however the engine
schedules it: one mixed batch, prefix-cache hits, tiny prefill chunks, KV so small it retracts."""

from __future__ import annotations

import random

import pytest
import torch

from radixpool.worker.config import EngineConfig
from radixpool.worker.engine_core import EngineCore
from radixpool.worker.messages import GenerateRequest
from radixpool.worker.sampling_params import SamplingParams

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
NEW_TOKENS = 12


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = [[rng.randrange(5, 1000) for _ in range(rng.randint(3, 70))] for _ in range(6)]
    shared = [rng.randrange(5, 1000) for _ in range(40)]  # a "system prompt" two requests share
    return [*base, shared + [11, 12, 13], shared + [21, 22], base[0] + [7, 8, 9]]


def reference(model_dir, batch: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for ids in batch:
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          min_new_tokens=NEW_TOKENS)
        out.append(gen[0, len(ids):].tolist())
    return out


def run(core: EngineCore, batch: list[list[int]], tag: str) -> tuple[list[list[int]], list[int]]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for i, ids in enumerate(batch):
        assert core.add_request(GenerateRequest(f"{tag}{i}", ids, params, seed=0)) is None
    tokens = {f"{tag}{i}": [] for i in range(len(batch))}
    cached = {}
    while core.has_work:
        for delta in core.step().deltas:
            tokens[delta.rid] += delta.token_ids
            if delta.finished:
                cached[delta.rid] = delta.cached_tokens
    core.check_invariants()
    return [tokens[f"{tag}{i}"] for i in range(len(batch))], \
        [cached[f"{tag}{i}"] for i in range(len(batch))]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers_under_every_schedule(tiny_model_factory, arch):
    model = str(tiny_model_factory(arch))
    batch = prompts()
    expected = reference(model, batch)

    # Plenty of KV, default chunking: one mixed batch, then the same prompts again (cache hits).
    core = EngineCore(EngineConfig(model, device="cpu", kv_cache_tokens=8192))
    got, cached = run(core, batch, "a")
    assert got == expected
    assert cached[-3] + cached[-2] >= 40, "the shared prefix was computed twice"
    got, cached = run(core, batch, "b")
    assert got == expected
    assert all(c >= len(ids) - 1 for c, ids in zip(cached, batch))

    # Prefill in 16-token chunks.
    core = EngineCore(EngineConfig(model, device="cpu", kv_cache_tokens=8192,
                                   chunked_prefill_size=16, max_prefill_tokens=16))
    got, _ = run(core, batch, "c")
    assert got == expected

    # KV for barely two sequences: requests are retracted and resumed, output unchanged.
    core = EngineCore(EngineConfig(model, device="cpu", kv_cache_tokens=180,
                                   chunked_prefill_size=16, max_prefill_tokens=64))
    got, _ = run(core, batch, "d")
    assert got == expected
    assert core.scheduler.retracted_total > 0


def test_paged_kv_gives_the_same_tokens(tiny_model):
    batch = prompts(1)
    expected = reference(str(tiny_model), batch)
    core = EngineCore(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=4096,
                                   page_size=4, chunked_prefill_size=16, max_prefill_tokens=32))
    got, cached = run(core, batch, "p")
    assert got == expected
    got, cached = run(core, batch, "q")
    assert got == expected
    assert all(c == (len(ids) - 1) // 4 * 4 for c, ids in zip(cached, batch)), \
        "page-aligned cache hits"


def test_a_shared_system_prompt_is_computed_once(tiny_model):
    core = EngineCore(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=8192))
    system = list(range(100, 228))  # 128 tokens
    batch = [system + [300 + i, 400 + i] for i in range(8)]
    _, cached = run(core, batch, "s")
    # Sent together: one computes the system prompt, the others are held and then hit it.
    assert sorted(cached)[1:] == [128] * 7
    assert sorted(cached)[0] == 0


def test_a_full_pool_gives_up_only_the_room_a_new_prompt_needs(tiny_model):
    """Page size 16, a pool that holds one 384-token system prompt and little else: an unrelated
    prompt takes only the room it needs from the end of the cached prefix, and the next request
    of that system prompt still reuses the rest, with the tokens a cold engine gives."""
    system = list(range(100, 484))
    after = system + [600, 601, 602]
    model = str(tiny_model)
    core = EngineCore(EngineConfig(model, device="cpu", kv_cache_tokens=512, page_size=16))
    run(core, [system + [500, 501]], "a")
    run(core, [list(range(700, 900))], "b")  # 200 tokens: more than the pool has free
    assert core.scheduler.kv.cache.evicted_tokens_total > 0
    got, cached = run(core, [after], "c")
    assert 256 <= cached[0] <= 384  # before: 0, the whole prefix went for ~100 tokens of room
    cold = EngineCore(EngineConfig(model, device="cpu", kv_cache_tokens=512, page_size=16))
    assert got == run(cold, [after], "d")[0]


def test_sliding_window_past_the_window_equals_transformers(tiny_model_factory, tmp_path):
    """A Mistral-7B-v0.1-style window (16 tokens here): prompts and outputs longer than it, a
    cached prefix reused by later requests, small chunks, and a KV pool small enough to retract
    all give transformers' tokens."""
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model_factory("mistral"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    rng = random.Random(3)
    shared = [rng.randrange(5, 1000) for _ in range(30)]
    batch = [[rng.randrange(5, 1000) for _ in range(n)] for n in (5, 17, 40, 63)]
    batch += [shared + [11, 12], shared + [21, 22, 23]]
    expected = reference(str(model), batch)

    for options in ({}, {"chunked_prefill_size": 8, "max_prefill_tokens": 16},
                    {"kv_cache_tokens": 200, "chunked_prefill_size": 16,
                     "max_prefill_tokens": 64}):
        core = EngineCore(EngineConfig(str(model), device="cpu",
                                       **{"kv_cache_tokens": 4096, **options}))
        assert core.runner.context_length == config["max_position_embeddings"]
        assert run(core, batch, "a")[0] == expected
        got, cached = run(core, batch, "b")
        assert got == expected
        assert cached[3] >= 62   # the 63-token prompt came back from the cache
