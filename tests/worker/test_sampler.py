"""The batched sampler: behaviour a user notices, checked against Hugging Face's processors."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from radixpool.worker.sampler import Sampler, SamplingRow, _gumbel, _hash32, request_seed
from radixpool.worker.sampling_params import SamplingParams

EOS = 2


def row(seed: int = 0, output: Sequence[int] | None = None, prompt: list[int] | None = None,
        key=None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, prompt or [], output or [], key)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (Wilson–Hilferty)."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def reference_warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Hugging Face's warpers in Hugging Face's order: the distribution we promise to sample."""
    x = logits.unsqueeze(0)
    ids = torch.zeros(1, 1, dtype=torch.long)
    x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p > 0:
        x = MinPLogitsWarper(p.min_p)(ids, x)
    return x.squeeze(0)


def draw(sampler: Sampler, logits: torch.Tensor, count: int, **params) -> torch.Tensor:
    """`count` samples from one distribution: one row per seed, all in one batch."""
    rows = [row(seed, **params) for seed in range(count)]
    tokens = sampler.sample(logits.expand(count, -1).contiguous(), rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[0])


def test_greedy_is_argmax_in_plain_and_mixed_batches():
    sampler = Sampler(512, (EOS,))
    logits = torch.randn(64, 512, generator=gen(1))
    expected = logits.argmax(-1).tolist()
    assert sampler.sample(logits, [row(temperature=0) for _ in range(64)]).token_ids == expected
    mixed = [row(i, temperature=0) if i % 2 else row(i, temperature=1.3, top_k=40)
             for i in range(64)]
    tokens = sampler.sample(logits, mixed).token_ids
    assert tokens[1::2] == expected[1::2]


def test_top_k_one_and_tiny_top_p_are_greedy():
    sampler = Sampler(300, (EOS,))
    logits = torch.randn(32, 300, generator=gen(2))
    expected = logits.argmax(-1).tolist()
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"top_p": 1e-6, "top_k": 50},
                   {"temperature": 1e-7}):
        params = {"temperature": 1.5, **params}
        rows = [row(seed, **params) for seed in range(32)]
        assert sampler.sample(logits, rows).token_ids == expected, params


@pytest.mark.parametrize("params", [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.5, "top_k": 6},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 0.9, "min_p": 0.1},
    {"temperature": 1.2, "top_k": 10, "top_p": 0.9, "min_p": 0.05},
])
def test_empirical_frequencies_match_the_promised_distribution(params):
    vocab, count = 24, 8000
    sampler = Sampler(vocab, (EOS,))
    logits = torch.randn(vocab, generator=gen(3)) * 1.5
    expected = torch.softmax(reference_warp(logits, SamplingParams(**params)), -1) * count
    observed = draw(sampler, logits, count, **params).double()
    allowed = expected > 0
    assert observed[~allowed].sum() == 0, "a filtered-out token was sampled"
    stat = ((observed[allowed] - expected[allowed]) ** 2 / expected[allowed]).sum().item()
    assert stat < chi_square_critical(int(allowed.sum()) - 1), (stat, observed, expected)


def test_steps_of_one_request_are_independent_draws():
    vocab, count = 12, 6000
    sampler = Sampler(vocab, (EOS,))
    logits = torch.randn(vocab, generator=gen(4))
    rows = [row(7, output=range(step)) for step in range(count)]  # one seed, successive steps
    tokens = sampler.sample(logits.expand(count, -1).contiguous(), rows).token_ids
    observed = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    expected = torch.softmax(logits, -1).double() * count
    assert ((observed - expected) ** 2 / expected).sum() < chi_square_critical(vocab - 1)


@pytest.mark.parametrize("params", [
    {"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.3}, {"top_k": 8, "top_p": 0.6, "min_p": 0.2},
])
def test_truncation_never_emits_excluded_tokens_at_vocab_scale(params):
    vocab, count = 4096, 128
    sampler = Sampler(vocab, (EOS,))
    logits = torch.randn(count, vocab, generator=gen(5)) * 3
    tokens = sampler.sample(logits, [row(seed, **params) for seed in range(count)]).token_ids
    for logit_row, token in zip(logits, tokens, strict=True):
        allowed = reference_warp(logit_row, SamplingParams(**params)).isfinite()
        assert allowed[token]


def test_top_p_wider_than_the_candidate_window_is_exact():
    """A flat distribution needs more than the first candidate window to reach top_p."""
    vocab, count = 5000, 400
    sampler = Sampler(vocab, (EOS,))
    logits = torch.randn(vocab, generator=gen(6)) * 0.05
    allowed = reference_warp(logits, SamplingParams(top_p=0.95)).isfinite()
    assert allowed.sum() > 2000
    distinct = draw(sampler, logits, count, top_p=0.95).nonzero().flatten()
    assert allowed[distinct].all()
    assert len(distinct) > 300  # sampled wide, not from the first window only


PARAMS = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    "top_k": st.sampled_from([-1, 0, 1, 5, 60, 500]),
    "top_p": st.sampled_from([1.0, 0.95, 0.6, 0.1]),
    "min_p": st.sampled_from([0.0, 0.05, 0.5]),
    "repetition_penalty": st.sampled_from([1.0, 1.3]),
    "frequency_penalty": st.sampled_from([0.0, 0.5]),
})


@settings(max_examples=40, deadline=None, derandomize=True)  # float ties at a boundary: no flakes
@given(params=PARAMS, others=st.lists(PARAMS, max_size=5), seed=st.integers(0, 2**64 - 1),
       position=st.integers(0, 5), step=st.integers(0, 40))
def test_a_row_is_sampled_the_same_in_any_batch_and_only_from_allowed_tokens(
        params, others, seed, position, step):
    vocab = 200
    sampler = Sampler(vocab, (EOS,))
    logits = torch.randn(1 + len(others), vocab, generator=gen(step)) * 2
    output = [7] * step
    mine = row(seed, output, [1, 2, 3], **params)
    alone = sampler.sample(logits[:1], [mine]).token_ids[0]
    position = min(position, len(others))
    batch = [row(i, [5] * i, [4], **p) for i, p in enumerate(others)]
    batch.insert(position, mine)
    order = [*range(1, position + 1), 0, *range(position + 1, len(others) + 1)]
    assert sampler.sample(logits[order], batch).token_ids[position] == alone
    penalised = RepetitionPenaltyLogitsProcessor(params["repetition_penalty"])(
        torch.tensor([[1, 2, 3, *output]]), logits[:1].clone())[0]
    penalised[7] -= step * params["frequency_penalty"] + 0.0
    p = SamplingParams(**params)
    allowed = (penalised == penalised.max() if p.greedy
               else reference_warp(penalised, p).isfinite())
    assert allowed[alone]


def test_same_seed_same_tokens_anywhere_in_any_batch():
    vocab = 1000
    sampler = Sampler(vocab, (EOS,))
    logits = torch.randn(8, vocab, generator=gen(8))
    mine = [row(1234, output=[3] * i, top_k=50, top_p=0.9, temperature=0.8) for i in range(8)]
    alone = [sampler.sample(logits[i:i + 1], [mine[i]]).token_ids[0] for i in range(8)]
    others = [row(s, temperature=t, top_p=p, min_p=m, frequency_penalty=0.5, logprobs=2)
              for s, t, p, m in [(1, 1.0, 1.0, 0.0), (2, 0.0, 1.0, 0.0), (3, 0.5, 0.3, 0.1)]]
    noise = torch.randn(3, vocab, generator=gen(9))
    batch = sampler.sample(torch.cat([noise, logits.flip(0)]), others + mine[::-1]).token_ids
    assert batch[3:][::-1] == alone
    again = sampler.sample(torch.cat([logits, noise]), mine + others).token_ids
    assert again[:8] == alone


def test_different_seeds_and_forks_differ():
    vocab = 1000
    sampler = Sampler(vocab, (EOS,))
    logits = torch.zeros(64, vocab)  # uniform: any correlation between seeds would show
    by_seed = sampler.sample(logits, [row(seed) for seed in range(64)]).token_ids
    assert len(set(by_seed)) > 55
    forks = [request_seed(99, fork) for fork in range(64)]
    assert forks[0] == 99 and len(set(forks)) == 64
    by_fork = sampler.sample(logits, [row(seed) for seed in forks]).token_ids
    assert len(set(by_fork)) > 55
    assert request_seed(None) != request_seed(None)


def test_penalties_match_reference_formulas():
    vocab, n = 64, 128
    sampler = Sampler(vocab, (EOS,))
    g = gen(10)
    logits = torch.randn(n, vocab, generator=g) * 0.5
    rows, expected = [], []
    for i in range(n):
        prompt = torch.randint(vocab, (int(torch.randint(1, 20, (1,), generator=g)),),
                               generator=g).tolist()
        output = torch.randint(vocab, (int(torch.randint(0, 20, (1,), generator=g)),),
                               generator=g).tolist()
        rep, freq, pres = 1 + i % 5 * 0.2, (i % 3 - 1) * 0.4, (i % 4 - 1.5) * 0.3
        rows.append(row(i, output, prompt, temperature=0, repetition_penalty=rep,
                        frequency_penalty=freq, presence_penalty=pres))
        ref = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([prompt + output]),
                                                    logits[i:i + 1].clone())[0]
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)
        ref -= counts * freq + (counts > 0) * pres
        expected.append(int(ref.argmax()))
    assert sampler.sample(logits, rows).token_ids == expected


def test_penalty_counts_kept_between_steps_equal_a_recount():
    vocab = 200
    remembering, recounting = Sampler(vocab, (EOS,)), Sampler(vocab, (EOS,))
    g = gen(11)
    outputs: list[list[int]] = [[], [], []]
    prompts = [[1, 2, 3], [4, 4, 5, 9], [7]]
    for _step in range(30):
        logits = torch.randn(3, vocab, generator=g)
        params = {"temperature": 0.9, "repetition_penalty": 1.4, "frequency_penalty": 1.0}
        keyed = [row(i, list(outputs[i]), prompts[i], key=f"req{i}", **params) for i in range(3)]
        fresh = [row(i, list(outputs[i]), prompts[i], **params) for i in range(3)]
        tokens = remembering.sample(logits, keyed).token_ids
        assert tokens == recounting.sample(logits, fresh).token_ids
        for i, t in enumerate(tokens):
            outputs[i].append(t)
    remembering.release("req0")
    # A reused key with a shorter history is recounted, not trusted.
    logits = torch.randn(1, vocab, generator=g)
    params = {"temperature": 0, "repetition_penalty": 2.0}
    reused = remembering.sample(logits, [row(5, [1], [2], key="req1", **params)]).token_ids
    assert reused == recounting.sample(logits, [row(5, [1], [2], **params)]).token_ids


def test_logit_bias_forces_and_bans_tokens():
    vocab = 500
    sampler = Sampler(vocab, (EOS,))
    logits = torch.randn(50, vocab, generator=gen(12)) * 4
    before = logits.clone()
    forced = sampler.sample(logits, [row(s, logit_bias={123: 100.0}) for s in range(50)])
    assert forced.token_ids == [123] * 50
    assert torch.equal(logits, before)  # the caller's logits are left alone
    half = sampler.sample(logits.half(), [row(s, logit_bias={123: 100.0}) for s in range(50)])
    assert half.token_ids == [123] * 50
    top = logits.argmax(-1).tolist()
    banned = sampler.sample(logits, [row(s, temperature=0, logit_bias={top[s]: -100.0})
                                     for s in range(50)])
    assert all(t != b for t, b in zip(banned.token_ids, top, strict=True))


def test_min_new_tokens_blocks_eos_and_stop_ids_until_reached():
    vocab = 100
    sampler = Sampler(vocab, (EOS, 3))
    logits = torch.zeros(6, vocab)
    logits[:, [EOS, 3, 40]] = torch.tensor([50.0, 49.0, 48.0])
    rows = [
        row(0, [9] * 2, min_new_tokens=4, temperature=0, stop_token_ids=(40,)),
        row(1, [9] * 2, min_new_tokens=4, temperature=1.0, stop_token_ids=(40,)),
        row(2, [9] * 4, min_new_tokens=4, temperature=0),
        row(3, [9] * 1, min_new_tokens=3, temperature=0, ignore_eos=True, stop_token_ids=(40,)),
        row(4, [], min_new_tokens=0, temperature=0),
        row(5, [9] * 2, min_new_tokens=5, temperature=0),
    ]
    tokens = sampler.sample(logits, rows).token_ids
    assert tokens[0] not in (EOS, 3, 40) and tokens[1] not in (EOS, 3, 40)
    assert tokens[2] == EOS and tokens[3] == EOS and tokens[4] == EOS
    assert tokens[5] == 40


def test_vocab_mask_limits_choices_in_one_batch():
    vocab = 300
    sampler = Sampler(vocab, (EOS,))
    logits = torch.randn(40, vocab, generator=gen(13))
    mask = torch.zeros(40, vocab, dtype=torch.bool)
    allowed = torch.randint(vocab, (40, 3), generator=gen(14))
    mask.scatter_(1, allowed, True)
    rows = [row(s, temperature=0 if s % 2 else 1.0) for s in range(40)]
    tokens = sampler.sample(logits, rows, vocab_mask=mask).token_ids
    assert all(t in allowed[i].tolist() for i, t in enumerate(tokens))
    mask[:2] = False  # nothing allowed (a finished grammar): the row ends with eos
    assert sampler.sample(logits, rows, vocab_mask=mask).token_ids[:2] == [EOS, EOS]


def test_logprobs_are_the_models_log_probabilities():
    vocab = 20
    sampler = Sampler(vocab, (EOS,))
    logits = torch.randn(4, vocab, generator=gen(15)) * 2
    rows = [row(0, temperature=0, logprobs=20), row(1, logprobs=5, top_k=3),
            row(2, temperature=0), row(3, logprobs=0, repetition_penalty=1.5, prompt=[1])]
    result = sampler.sample(logits, rows)
    reference = torch.log_softmax(logits, -1)
    full = result.top_logprobs[0]
    assert math.isclose(sum(math.exp(lp) for _, lp in full), 1.0, rel_tol=1e-5)
    assert [lp for _, lp in full] == sorted((lp for _, lp in full), reverse=True)
    assert full[0][0] == result.token_ids[0]
    assert full[0][1] == pytest.approx(result.logprobs[0])
    assert len(result.top_logprobs[1]) == 5
    assert result.logprobs[1] == pytest.approx(reference[1, result.token_ids[1]].item())
    assert result.logprobs[2] is None and result.top_logprobs[2] is None
    assert result.top_logprobs[3] == []
    assert result.logprobs[3] == pytest.approx(reference[3, result.token_ids[3]].item())
    plain = sampler.sample(logits, [row(0, temperature=0)] * 4)
    assert plain.logprobs is None and plain.top_logprobs is None


def test_wrong_logits_shape_is_rejected():
    sampler = Sampler(10, (EOS,))
    with pytest.raises(ValueError, match="logits"):
        sampler.sample(torch.zeros(2, 11), [row(), row()])


@pytest.mark.parametrize("top_k", [-1, 1 << 16])   # whole vocabulary; top-k candidates
def test_a_disallowed_token_is_never_drawn_at_a_real_vocabulary_size(top_k):
    # The Gumbel noise came from a 24-bit uniform computed in float32, where the largest value
    # rounded up to 1.0: that token's noise was +inf, and with a -inf (masked) logit the sum was
    # NaN, which argmax takes. With a Qwen-size vocabulary about 1 sampled step in 100 met it:
    # a third of the grammar-constrained outputs on a GPU broke their grammar, and unmasked
    # rows drew a uniformly random token. Here one token is allowed; every draw must be it.
    vocab, rows, allowed = 1 << 17, 128, 7
    sampler = Sampler(vocab, eos_token_ids=[2])
    mask = torch.zeros(rows, vocab, dtype=torch.bool)
    mask[:, allowed] = True
    params = SamplingParams(temperature=1.0, top_k=top_k)
    for batch in range(8):   # 1,024 steps: at this vocabulary ~8 of them drew an infinite noise
        chosen = sampler.sample(
            torch.zeros(rows, vocab),
            [SamplingRow(params, seed=11, prompt_ids=[], output_ids=[], generated=batch * rows + i)
             for i in range(rows)], vocab_mask=mask).token_ids
        assert set(chosen) == {allowed}, (batch, sorted(set(chosen) - {allowed}))


def _unhash32(h: int) -> int:
    """The key that the sampler's 32-bit hash maps to h (each of its steps is invertible)."""
    def unshift(x: int, s: int) -> int:
        y = x
        for _ in range(32 // s + 1):
            y = x ^ (y >> s)
        return y & 0xFFFFFFFF
    h = unshift(h, 15)
    h = (h * pow(0x297A2D39, -1, 1 << 32)) & 0xFFFFFFFF
    h = unshift(h, 12)
    h = (h * pow(0x2C1B3C6D, -1, 1 << 32)) & 0xFFFFFFFF
    return unshift(h, 15)


def test_far_tail_tokens_keep_their_chance_at_a_real_vocabulary_size():
    # The token that wins a draw has its uniform u within ~1/V of 1, and the noise came from u
    # held in float32 (24 bits): every hash in the top 2^-24 got the same noise, 16.6, where
    # the exact noise runs on to 23. A token more than ~17 nats below the top one was then
    # never drawn: at V = 151,936 a tail of such tokens lost up to 0.3% of the draws (e.g.
    # 0.6% promised, 0.3% drawn). Here: the noise of the 4,096 largest 32-bit hashes, and of
    # some in the middle, against -log(-log u) in float64.
    hashes = [0xFFFFFFFF - i for i in range(1 << 12)] + [(1 << 31) + i for i in range(1 << 12)]
    keys = torch.tensor([_unhash32(h) for h in hashes])
    assert _hash32(keys.clone()).tolist() == hashes
    u = (torch.tensor(hashes, dtype=torch.float64) + 0.5) / 2.0 ** 32
    noise = _gumbel(keys, torch.zeros(1, 1, dtype=torch.long)).squeeze(0).double()
    assert noise[0] > 22.8   # u = 1 - 2^-33
    assert torch.allclose(noise, -torch.log(-torch.log(u)), rtol=0, atol=1e-5)
