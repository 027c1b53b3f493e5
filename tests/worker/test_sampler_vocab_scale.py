"""The sampler at real vocabulary sizes (32,000 to Qwen's 151,936), with logits shaped like a
model's: a few tokens hold most of the mass and a long tail the rest.

Frequencies are compared with the distribution computed in float64 from the same logits by a
chi-square test over buckets of at least 10 expected draws, at the critical value of p = 1e-5
(the draws are fixed by their seeds, so a test passes or fails the same way every run).
"""

from __future__ import annotations

import math

import pytest
import torch

from radixpool.worker.sampler import NONFINITE, Sampler, SamplingRow
from radixpool.worker.sampling_params import SamplingParams

QWEN = 151_936
BATCH = 256


def peaked(vocab: int, seed: int = 1) -> torch.Tensor:
    """20 head tokens (about 80% of the mass at temperature 1) over a random tail."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * 2.0
    head = torch.randperm(vocab, generator=g)[:20]
    x[head] = 16.0 - 0.7 * torch.arange(20, dtype=torch.float32)
    return x


def sharp(vocab: int, seed: int = 2) -> torch.Tensor:
    """One token near certain, the tail 15 to 25 nats below it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * 2.5 + 5.0
    x[torch.randperm(vocab, generator=g)[:5]] = torch.tensor([22.0, 20.5, 19.0, 18.0, 17.0])
    return x


def flat(vocab: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 0.5


def exact(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The promised distribution in float64: temperature, top-k, top-p over the top-k
    renormalised distribution, then min-p (the Hugging Face order)."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    order = torch.argsort(probs, descending=True, stable=True)
    q = probs[order]
    if 0 < p.top_k < len(q):
        q[p.top_k:] = 0
    q /= q.sum()
    if p.top_p < 1:
        q[torch.cumsum(q, 0) - q >= p.top_p] = 0
        q /= q.sum()
    if p.min_p > 0:
        q[q < p.min_p * q[0]] = 0
        q /= q.sum()
    return torch.zeros_like(probs).index_put_((order,), q)


def draw(sampler: Sampler, logits: torch.Tensor, count: int, params: SamplingParams,
         mask: torch.Tensor | None = None) -> torch.Tensor:
    """Token counts of `count` draws, one seed per row, BATCH rows per call."""
    counts = torch.zeros(len(logits), dtype=torch.long)
    for start in range(0, count, BATCH):
        rows = [SamplingRow(params, start + i, [], []) for i in range(BATCH)]
        tokens = sampler.sample(logits.expand(BATCH, -1), rows,
                                None if mask is None else mask.expand(BATCH, -1)).token_ids
        counts += torch.bincount(torch.tensor(tokens), minlength=len(logits))
    return counts


def chi_square(counts: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value at p = 1e-5) over buckets of tokens in order of target
    probability, each with at least 10 expected draws."""
    n = int(counts.sum())
    order = torch.argsort(target, descending=True)
    expected, observed, e, o = [], [], 0.0, 0.0
    for q, c in zip(target[order].tolist(), counts[order].tolist()):
        if q == 0:
            break
        e, o = e + q * n, o + c
        if e >= 10:
            expected.append(e)
            observed.append(o)
            e = o = 0.0
    expected[-1] += e
    observed[-1] += o
    exp_t, obs_t = torch.tensor(expected), torch.tensor(observed)
    df = max(len(expected) - 1, 1)
    c = 2 / (9 * df)   # Wilson–Hilferty, z = 4.26
    return float(((obs_t - exp_t) ** 2 / exp_t).sum()), df * (1 - c + 4.26 * math.sqrt(c)) ** 3


@pytest.mark.parametrize(("vocab", "shape", "params"), [
    (32_000, sharp, dict(temperature=0.7)),
    (32_000, peaked, dict(temperature=1.0)),
    (32_000, flat, dict(temperature=1.5)),
    (32_000, flat, dict(temperature=0.7, min_p=0.05)),
    (QWEN, peaked, dict(top_k=40)),
    (QWEN, sharp, dict(top_k=1000, temperature=1.5)),
    (QWEN, peaked, dict(top_p=0.9, temperature=0.7)),
    (QWEN, sharp, dict(top_p=0.999, temperature=0.7)),
    (QWEN, peaked, dict(top_k=1000, top_p=0.9, min_p=0.05, temperature=1.5)),
    (32_000, sharp, dict(top_p=0.99)),   # the candidate window widens to the whole vocabulary
], ids=lambda v: getattr(v, "__name__", None))
def test_frequencies_match_the_exact_distribution(vocab, shape, params):
    logits, p = shape(vocab), SamplingParams(**params)
    target = exact(logits, p)
    counts = draw(Sampler(vocab, [2]), logits, 1024, p)
    assert int(counts[target == 0].sum()) == 0, "a token outside top-k / top-p / min-p drawn"
    statistic, critical = chi_square(counts, target)
    assert statistic < critical


def test_tokens_just_past_the_top_p_and_min_p_boundaries_are_never_drawn():
    sampler = Sampler(QWEN, [2])
    g = torch.Generator().manual_seed(9)
    tail = torch.randn(QWEN, generator=g)
    logits = tail - torch.logsumexp(tail, 0) + math.log(0.01)   # a tail holding 1%
    logits[100:104] = torch.tensor([0.5, 0.3, 0.15, 0.04]).log()
    # token 103 starts at mass 0.95: out just below, in just above
    below = draw(sampler, logits, 512, SamplingParams(top_p=0.95 - 1e-5))
    above = draw(sampler, logits, 512, SamplingParams(top_p=0.95 + 1e-5))
    assert below[103] == 0 and above[103] > 5   # 20 expected
    assert below.sum() == below[100:103].sum() and above.sum() == above[100:104].sum()
    logits = torch.full((QWEN,), -40.0)
    logits[:3] = torch.tensor([1.0, 0.0499, 0.0501]).log()
    counts = draw(sampler, logits, 256, SamplingParams(min_p=0.05))
    assert counts[1] == 0 and counts[2] > 3 and counts.sum() == counts[:3].sum()


@pytest.mark.parametrize("params", [dict(), dict(top_k=1000), dict(top_p=0.9),
                                    dict(top_k=QWEN - 1)])
def test_masked_banned_and_biased_tokens_are_never_drawn(params):
    # eos (banned until 4 tokens) and token 77 (logit_bias -100) would otherwise take 95% of
    # the draws; half the vocabulary is masked
    mask = torch.rand(QWEN, generator=torch.Generator().manual_seed(4)) < 0.5
    mask[[2, 77]] = True
    logits = torch.zeros(QWEN)
    logits[[2, 77]] = 15.0
    p = SamplingParams(min_new_tokens=4, logit_bias={77: -100.0}, **params)
    counts = draw(Sampler(QWEN, [2]), logits, 256, p, mask)
    assert counts[~mask].sum() == 0 and counts[2] == 0 and counts[77] == 0


def test_consecutive_steps_of_one_request_are_independent():
    sampler = Sampler(QWEN, [2])
    logits = torch.randn(QWEN, generator=torch.Generator().manual_seed(7)) * 2.0
    logits[:4] = torch.tensor([14.0, 13.5, 13.0, 12.5])
    p = SamplingParams(top_k=40)
    tokens: list[int] = []
    for start in range(0, 2048, BATCH):
        rows = [SamplingRow(p, 12345, [], [], generated=start + i) for i in range(BATCH)]
        tokens += sampler.sample(logits.expand(BATCH, -1), rows).token_ids
    kinds = torch.tensor(tokens).clamp(max=4)   # the four head tokens, and the rest
    table = torch.zeros(5, 5)
    table.index_put_((kinds[:-1], kinds[1:]), torch.ones(len(kinds) - 1), accumulate=True)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    assert statistic < 54.2   # chi-square, 16 degrees of freedom, p = 1e-5


def test_logprobs_at_a_real_vocabulary_size_are_the_models():
    # before penalties, bias, temperature and truncation: log_softmax of the raw logits
    logits = torch.stack([sharp(QWEN) * 1.5, peaked(QWEN), flat(QWEN)])
    rows = [SamplingRow(SamplingParams(logprobs=20, temperature=0.7, top_k=50,
                                       repetition_penalty=1.3, logit_bias={5: 30.0}),
                        4, [1, 2, 3], []),
            SamplingRow(SamplingParams(logprobs=5), 13, [], []),
            SamplingRow(SamplingParams(logprobs=0, temperature=0), 3, [], [])]
    result = Sampler(QWEN, [2]).sample(logits, rows)
    reference = torch.log_softmax(logits.double(), -1)
    assert result.token_ids[0] == 5   # the bias decided it; the logprob is still the model's
    for i, r in enumerate(rows):
        assert result.logprobs[i] == pytest.approx(
            reference[i, result.token_ids[i]].item(), abs=1e-4)
        top = result.top_logprobs[i]
        assert [t for t, _ in top] == reference[i].topk(r.params.logprobs).indices.tolist()
        assert [v for _, v in top] == pytest.approx(
            reference[i].topk(r.params.logprobs).values.tolist(), abs=1e-4)
        assert all(math.isfinite(v) for _, v in top)


@pytest.mark.parametrize("params", [dict(), dict(top_p=0.9), dict(top_k=40), dict(min_p=0.1),
                                    dict(temperature=0)])
def test_an_extreme_row_leaves_the_rest_of_its_batch_alone(params):
    sampler = Sampler(QWEN, [2])
    logits = peaked(QWEN)
    p = SamplingParams(**params)
    alone = [sampler.sample(logits[None], [SamplingRow(p, i, [], [])]).token_ids[0]
             for i in range(3)]
    for token, value in [(7, 1e4), (11, math.inf), (13, math.nan)]:
        extreme = logits.clone()
        extreme[token] = value
        batch = torch.stack([logits, extreme, logits, logits])
        tokens = sampler.sample(batch, [SamplingRow(p, i, [], []) for i in (0, 1, 1, 2)]).token_ids
        assert [tokens[0], tokens[2], tokens[3]] == alone
        # a NaN or infinite logit is flagged (the engine ends that request), a large one is not
        assert tokens[1] == (token if math.isfinite(value) else NONFINITE)


@pytest.mark.parametrize("seed", [0, 2**32 - 1, 2**63 - 1, -1, -2**63])
def test_any_integer_seed_replays(seed):
    sampler = Sampler(QWEN, [2])
    logits = peaked(QWEN)
    p = SamplingParams(seed=seed, temperature=1.5)
    rows = [SamplingRow(p, seed, [], [], generated=step) for step in range(32)]
    first = sampler.sample(logits.expand(32, -1), rows).token_ids
    assert sampler.sample(logits.expand(32, -1), rows).token_ids == first
    assert len(set(first)) > 3   # the steps differ
    # the low 64 bits count: -1 is 2^64 - 1
    same = [SamplingRow(p, seed % 2**64, [], [], generated=step) for step in range(32)]
    assert sampler.sample(logits.expand(32, -1), same).token_ids == first
