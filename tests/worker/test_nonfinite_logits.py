"""A model that gives one request NaN or infinite logits (fp16 overflow, a bad checkpoint, a
kernel bug) ends that request with an error saying so, counted in the stats; the other requests
of the batch get exactly the tokens they get without the fault, and no KV is lost. Overlapped
loop and synchronous loop alike: the flag travels with the tokens."""

from __future__ import annotations

import math

import pytest
import torch

from radixpool.worker.config import EngineConfig
from radixpool.worker.engine_core import EngineCore
from radixpool.worker.messages import GenerateRequest
from radixpool.worker.sampler import NONFINITE, Sampler, SamplingRow
from radixpool.worker.sampling_params import SamplingParams

VICTIM = "victim"
FAULT_AT = 3   # the victim's row goes bad in the step that samples its 4th output token

KINDS = {
    "greedy": dict(temperature=0),
    "sampled": dict(temperature=0.8, top_p=0.9),
    "top_k": dict(temperature=0.7, top_k=20),
    "logprobs": dict(temperature=0.8, logprobs=3),
    "penalised": dict(temperature=0.8, frequency_penalty=0.5),
}
POISONS = {
    "nan_row": lambda row: row.fill_(math.nan),
    "one_nan": lambda row: row.__setitem__(17, math.nan),
    "one_inf": lambda row: row.__setitem__(17, math.inf),
    "all_neg_inf": lambda row: row.fill_(-math.inf),
}


def poison_victim(core: EngineCore, poison) -> None:
    """Wrap the model's forward: the victim's logits row goes bad once it has FAULT_AT tokens."""
    scheduled = []
    next_batch, forward = core.scheduler.next_batch, core.runner.forward

    def remember(*args, **kwargs):
        batch = next_batch(*args, **kwargs)
        scheduled.append(batch)
        return batch

    def faulty(fb):
        logits = forward(fb)
        batch = scheduled[-1]
        sampled = [r for r, wants in zip(batch.reqs, batch.sample) if wants]
        for i, req in enumerate(sampled):
            if req.rid == VICTIM and len(req.output_ids) + req.pending - 1 >= FAULT_AT:
                poison(logits[i])
        return logits

    core.scheduler.next_batch = remember
    core.runner.forward = faulty


def run(model: str, overlap: bool, kind: str, poison=None) -> tuple[dict, EngineCore]:
    core = EngineCore(EngineConfig(model, device="cpu", kv_cache_tokens=2048, page_size=4,
                                   overlap_schedule=overlap, debug_invariants=True))
    if poison is not None:
        poison_victim(core, poison)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, **KINDS[kind])
    rids = ["a", VICTIM, "b", "c"]
    out = {rid: {"tokens": [], "deltas": []} for rid in rids}
    for i, rid in enumerate(rids):
        prompt = [(11 * i + 7 * j) % 900 + 5 for j in range(9 + 3 * i)]
        assert core.add_request(GenerateRequest(rid, prompt, params, seed=i)) is None
    steps = 0
    while core.has_work:
        steps += 1
        assert steps < 200
        for delta in core.step().deltas:
            out[delta.rid]["tokens"] += delta.token_ids
            out[delta.rid]["deltas"].append(delta)
        core.check_invariants()
    core.flush_cache()
    core.check_invariants()
    return out, core


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("poison", list(POISONS))
def test_a_request_with_nonfinite_logits_ends_with_an_error_and_alone(tiny_model, overlap, kind,
                                                                     poison, caplog):
    clean, _ = run(str(tiny_model), overlap, kind)
    with caplog.at_level("ERROR", logger="radixpool.core"):
        faulty, core = run(str(tiny_model), overlap, kind, POISONS[poison])
    for rid in ("a", "b", "c"):
        assert faulty[rid]["tokens"] == clean[rid]["tokens"], rid
        assert faulty[rid]["deltas"][-1].finish_reason == "length"
    victim = faulty[VICTIM]
    last = victim["deltas"][-1]
    assert last.finished and last.finish_reason == "abort" and last.internal_error
    assert last.error_code == "nonfinite_logits"   # a gateway's breaker leaves it out
    assert "non-finite logits" in last.error
    # the tokens before the fault, none after it, and never the flag
    assert victim["tokens"] == clean[VICTIM]["tokens"][:FAULT_AT]
    assert all(math.isfinite(lp) for d in victim["deltas"] for lp in d.logprobs or ())
    assert core.stats().nonfinite_logits_total == 1
    logged = [r for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(logged) == 1 and VICTIM in logged[0].getMessage()
    assert core.runner.kv_pool.available_size() == core.runner.kv_pool.capacity


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0.8),
                                    dict(temperature=0.8, top_p=0.9), dict(top_k=5),
                                    dict(temperature=0.8, logprobs=2),
                                    dict(temperature=0, logprobs=0),
                                    dict(temperature=0.8, logit_bias={3: 5.0})])
def test_the_sampler_flags_nonfinite_rows_and_leaves_the_others_alone(params):
    vocab = 1000
    sampler = Sampler(vocab, [2])
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 3
    p = SamplingParams(**params)
    rows = [SamplingRow(p, i, [], []) for i in range(4)]
    clean = sampler.sample(logits, rows)
    for poison in POISONS.values():
        bad = logits.clone()
        poison(bad[1])
        result = sampler.sample(bad, rows)
        assert result.token_ids[1] == NONFINITE
        for i in (0, 2, 3):
            assert result.token_ids[i] == clean.token_ids[i]
            if clean.logprobs is not None:
                assert result.logprobs[i] == clean.logprobs[i]
                assert result.top_logprobs[i] == clean.top_logprobs[i]
        # what the row's next step reads as its input is still a token of the vocabulary
        assert 0 <= int(result.inputs[1]) < vocab


def test_a_token_with_no_mass_is_not_a_fault():
    """-inf logits the model gave some tokens (not all) are a distribution: no flag."""
    vocab = 100
    sampler = Sampler(vocab, [2])
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1))
    logits[0, 50:] = -math.inf
    result = sampler.sample(logits, [SamplingRow(SamplingParams(temperature=0, logprobs=5),
                                                 0, [], [])])
    assert result.token_ids[0] == int(logits.argmax())
    assert math.isfinite(result.logprobs[0])
