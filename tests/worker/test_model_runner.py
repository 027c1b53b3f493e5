"""Our model runner computes what Hugging Face `transformers` computes on the same weights (fp32,
CPU): a mixed-length EXTEND batch, an EXTEND on top of a prefix already in the pool, tiny chunks,
batched DECODE steps, and greedy generation."""

from __future__ import annotations

import pytest
import torch
from model_driver import Driver

from radixpool.worker.config import EngineConfig
from radixpool.worker.model_runner import ModelRunner

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    """`get(arch, **config) -> (runner, hf_model)`, one pair per (arch, config) per module."""
    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def get(arch: str, **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tiny_model_factory(arch)
            config = dict(device="cpu", kv_cache_tokens=2048, max_running_requests=16)
            config.update(overrides)
            runner = ModelRunner(EngineConfig(model_path=str(path), **config))
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[key] = (runner, hf)
        return cache[key]

    return get


def random_prompt(length: int, seed: int, vocab: int = 1024) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (length,), generator=generator).tolist()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_length_extend_matches_hf(models, arch):
    runner, hf = models(arch)
    driver = Driver(runner)
    prompts = [random_prompt(n, seed=n) for n in (1, 9, 37, 4)]
    seqs = [driver.new_seq() for _ in prompts]
    logits = driver.extend(seqs, prompts, all_positions=True)
    assert logits.dtype == torch.float32
    assert logits.shape == (sum(map(len, prompts)), runner.vocab_size)
    for got, prompt in zip(logits.split([len(p) for p in prompts]), prompts):
        torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_prefix_tiny_chunks_and_decode_match_hf(models, arch):
    runner, hf = models(arch)
    driver = Driver(runner)
    system = random_prompt(20, seed=1)
    first = driver.new_seq()
    driver.extend([first], [system])
    # A second request hits the cache for the shared 20 tokens and prefills its own 30 tokens in
    # chunks of 16, batched with a fresh prompt that has no prefix at all.
    full = system + random_prompt(30, seed=2)
    second = driver.share_prefix(first, len(system))
    fresh = driver.new_seq()
    fresh_prompt = random_prompt(5, seed=3)
    chunks = [full[20:36], full[36:]]
    logits = driver.extend([second, fresh], [chunks[0], fresh_prompt], all_positions=True)
    reference = hf_logits(hf, full)
    torch.testing.assert_close(logits[:16], reference[20:36], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[16:], hf_logits(hf, fresh_prompt), atol=ATOL, rtol=0)
    logits = driver.extend([second], [chunks[1]], all_positions=True)
    torch.testing.assert_close(logits, reference[36:], atol=ATOL, rtol=0)

    # Decode all three together (the first still shares its KV with the second).
    seqs = [first, second, fresh]
    next_tokens = [hf_logits(hf, s.ids)[-1].argmax().item() for s in seqs]
    for _ in range(4):
        logits = driver.decode(seqs, next_tokens)
        for got, seq in zip(logits, seqs):
            torch.testing.assert_close(got, hf_logits(hf, seq.ids)[-1], atol=ATOL, rtol=0)
        next_tokens = logits.argmax(-1).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_hf_generate(models, arch):
    runner, hf = models(arch)
    prompts = [random_prompt(n, seed=10 + n) for n in (3, 12, 26)]
    ours = Driver(runner).greedy(prompts, max_new_tokens=12)
    for prompt, got in zip(prompts, ours):
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), do_sample=False, max_new_tokens=12)
        assert got == out[0, len(prompt):].tolist()


def test_pages_larger_than_one_token(models):
    runner, hf = models("qwen3", page_size=4)
    assert runner.kv_pool.page_size == 4
    prompts = [random_prompt(n, seed=20 + n) for n in (6, 13)]
    ours = Driver(runner).greedy(prompts, max_new_tokens=8)
    for prompt, got in zip(prompts, ours):
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), do_sample=False, max_new_tokens=8)
        assert got == out[0, len(prompt):].tolist()


def test_bfloat16_weights_and_cache(models):
    fp32, _ = models("llama")
    bf16, _ = models("llama", dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and bf16.kv_pool.k_buffers[0].dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    prompt = random_prompt(16, seed=4)
    a, b = (Driver(r).prompt_logits(prompt) for r in (fp32, bf16))
    assert b.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.99


def test_runner_facts(models):
    runner, hf = models("llama")
    assert runner.architecture == "LlamaForCausalLM"
    assert runner.device == torch.device("cpu") and runner.dtype == torch.float32
    assert runner.attention_backend_name == "torch"
    assert runner.vocab_size == hf.config.vocab_size
    assert runner.context_length == hf.config.max_position_embeddings
    assert runner.eos_token_ids == (2, 4)  # config.json's 2 and generation_config.json's [2, 4]
    assert (runner.num_layers, runner.num_kv_heads, runner.head_dim) == (2, 2, 16)
    assert runner.kv_pool.capacity == 2048
    assert runner.req_to_token_pool.table.shape[1] == runner.context_length
    assert runner.req_to_token_pool.table.shape[0] > 16  # max_running_requests + spare rows
