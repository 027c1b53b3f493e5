"""On a GPU: the sampler picks the very tokens the CPU sampler picks from the same float32
logits, for every kind of row in one mixed batch (greedy, temperature, top-k, top-p, min-p,
penalties, logit_bias, min_new_tokens, a grammar mask, logprobs). Its randomness is integer
hashing keyed by seed, step and token id, exact on any device, so a seeded request replays the
same tokens whichever device serves it.

Skipped without CUDA (these machines have none); `test_sampler.py` checks the distributions.
"""

from __future__ import annotations

import pytest
import torch

from radixpool.worker.sampler import Sampler, SamplingRow
from radixpool.worker.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (none on this machine)")
VOCAB = 32000   # wider than the sampler's top-p candidate window
EOS = 2
PARAMS = [
    dict(temperature=0),
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=40),
    dict(temperature=0.9, top_p=0.9),
    dict(temperature=1.2, top_p=0.999),   # outgrows the first candidate window
    dict(temperature=1.0, top_k=100, top_p=0.8, min_p=0.05),
    dict(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5,
         presence_penalty=0.4),
    dict(temperature=1.0, logit_bias={7: 100.0}),
    dict(temperature=1.0, min_new_tokens=5),
    dict(temperature=1.0, logprobs=3),
    dict(temperature=0, logprobs=0),
]


def make_rows(count: int) -> list[SamplingRow]:
    rows = []
    for i in range(count):
        prompt = [(i * 37 + j * 11) % VOCAB for j in range(20)]
        output = [(i * 53 + j * 7) % VOCAB for j in range(i % 4)]
        rows.append(SamplingRow(SamplingParams(**PARAMS[i % len(PARAMS)]), seed=1000 + i,
                                prompt_ids=prompt, output_ids=output, key=None))
    return rows


@pytest.mark.parametrize("masked", [False, True])
def test_cuda_sampler_picks_the_cpu_samplers_tokens(masked):
    gen = torch.Generator().manual_seed(3)
    rows = make_rows(3 * len(PARAMS))
    logits = torch.randn(len(rows), VOCAB, generator=gen) * 4
    mask = mask_rows = None
    if masked:   # a grammar allowing a tenth of the vocabulary on every other row
        mask_rows = list(range(0, len(rows), 2))
        mask = torch.rand(len(mask_rows), VOCAB, generator=gen) < 0.1
    cpu = Sampler(VOCAB, EOS, "cpu").sample(logits.clone(), rows, vocab_mask=mask,
                                            mask_rows=mask_rows)
    gpu = Sampler(VOCAB, EOS, "cuda").sample(
        logits.cuda(), rows, vocab_mask=None if mask is None else mask.cuda(),
        mask_rows=mask_rows)
    assert gpu.token_ids == cpu.token_ids
    assert gpu.tensor.device.type == "cuda"
    for got, want in zip(gpu.logprobs, cpu.logprobs):
        assert (got is None) == (want is None)
        if want is not None:
            assert got == pytest.approx(want, abs=1e-4)
    for got, want in zip(gpu.top_logprobs, cpu.top_logprobs):
        assert (got is None) == (want is None)
        if want is not None:
            assert [t for t, _ in got] == [t for t, _ in want]


def test_tokens_kept_on_the_device_equal_the_host_tokens():
    rows = make_rows(len(PARAMS) - 2)   # no logprobs: the tokens may stay on the device
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(5)).cuda()
    sampler = Sampler(VOCAB, EOS, "cuda")
    on_device = sampler.sample(logits, rows, to_host=False)
    assert on_device.token_ids is None and on_device.tensor.device.type == "cuda"
    assert on_device.tensor.tolist() == Sampler(VOCAB, EOS, "cpu").sample(logits.cpu(),
                                                                          rows).token_ids


@pytest.mark.parametrize("top_k", [-1, 1 << 16])   # whole vocabulary; top-k candidates
def test_a_masked_token_is_never_drawn_on_the_gpu_at_qwens_vocabulary(top_k):
    # The GPU twin of test_sampler.py's check: the soak on an H100 saw a third of the grammar
    # outputs break when the Gumbel uniform rounded to 1.0 (noise +inf, masked logit -inf: NaN,
    # which argmax takes). 2,048 steps at 151,936 tokens met that about 18 times before the fix.
    vocab, rows, allowed = 151936, 256, 7
    sampler = Sampler(vocab, EOS, "cuda")
    mask = torch.zeros(rows, vocab, dtype=torch.bool, device="cuda")
    mask[:, allowed] = True
    params = SamplingParams(temperature=1.0, top_k=top_k)
    for batch in range(8):
        chosen = sampler.sample(
            torch.zeros(rows, vocab, device="cuda"),
            [SamplingRow(params, seed=11, prompt_ids=[], output_ids=[],
                         generated=batch * rows + i) for i in range(rows)],
            vocab_mask=mask).token_ids
        assert set(chosen) == {allowed}, (batch, sorted(set(chosen) - {allowed}))
