"""The warm-up a worker runs before it says it is ready: it goes through the forward paths a
first request takes (a fresh prefill, a prefill over a cached prefix, decode steps, the sampling
paths), and afterwards nothing a client or the gateway sees differs from a core that never ran
it. A fault during warm-up stops the start, naming the warm-up."""

from __future__ import annotations

import socket

import pytest
from test_overlap_equivalence import workload

from radixpool.worker.config import EngineConfig
from radixpool.worker.core_process import run_core
from radixpool.worker.engine_core import EngineCore
from radixpool.worker.forward_batch import ForwardMode
from radixpool.worker.ipc import Inbox
from radixpool.worker.messages import CoreFailed, CoreReady, GenerateRequest


def config(model, **kw) -> EngineConfig:
    kw = dict(device="cpu", kv_cache_tokens=256, chunked_prefill_size=16, max_prefill_tokens=48,
              debug_invariants=True) | kw
    return EngineConfig(str(model), **kw)


def serve(core: EngineCore, seed: int) -> dict:
    """Run `workload(seed)` (shared prefixes, seeded forks, penalties, stop tokens, tight KV)
    to the end: each request's tokens and finish reason, and every cache event."""
    reqs, _ = workload(seed)
    out = {rid: [[], None] for rid, *_ in reqs}
    for rid, ids, params, s in reqs:
        assert core.add_request(GenerateRequest(rid, ids, params, s)) is None
    events = []
    while core.has_work:
        step = core.step()
        events += [(e.seq, e.type, e.blocks) for e in step.events]
        for delta in step.deltas:
            out[delta.rid][0] += delta.token_ids
            out[delta.rid][1] = delta.finish_reason
    return {"outputs": out, "events": events, "retracted": core.scheduler.retracted_total,
            "stats": core.stats()}


@pytest.mark.parametrize("seed,page_size,kv_tokens", [(0, 1, 160), (3, 16, 256), (2, 4, 4096)])
def test_a_warmed_core_serves_exactly_what_a_cold_one_does(tiny_model, seed, page_size,
                                                           kv_tokens):
    cfg = config(tiny_model, page_size=page_size, kv_cache_tokens=kv_tokens)
    cold = EngineCore(cfg)
    warm = EngineCore(cfg)
    assert warm.warm_up() > 0
    # nothing of the warm-up is left: an empty tree, the whole pool free, no pending events,
    # counters at zero
    assert warm.cache.total_size == 0 and not warm.cache.events
    assert warm.runner.kv_pool.available_size() == warm.runner.kv_pool.capacity
    assert warm.stats() == cold.stats()
    assert warm.times.steps == 0
    # the same tokens, finish reasons, cache events (numbered from 1) and retractions
    assert serve(warm, seed) == serve(cold, seed)


def test_the_warm_up_runs_every_forward_path_a_first_request_takes(tiny_model):
    core = EngineCore(config(tiny_model, page_size=16, kv_cache_tokens=512))
    seen = []
    forward = core.runner.forward

    def spy(batch):
        cached = any(n > 0 for n in batch.prefix_lens) if batch.mode != ForwardMode.DECODE \
            else None
        seen.append((batch.mode, cached))
        return forward(batch)

    core.runner.forward = spy
    samples = []
    sample = core.sampler.sample

    def spy_sample(logits, rows, **kw):
        samples.extend(rows)
        return sample(logits, rows, **kw)

    core.sampler.sample = spy_sample
    steps = core.warm_up()
    assert steps == len(seen)
    modes = {mode for mode, _ in seen}
    assert ForwardMode.DECODE in modes
    prefills = [cached for mode, cached in seen if mode != ForwardMode.DECODE]
    assert False in prefills, "no fresh prefill (nothing cached) ran"
    assert True in prefills, "no prefill over a cached prefix ran"
    assert any(r.params.temperature == 0 for r in samples)
    drawn = [r.params for r in samples if r.params.temperature > 0]
    assert drawn and drawn[0].top_k > 0 and drawn[0].top_p < 1 and drawn[0].logprobs
    assert drawn[0].frequency_penalty and drawn[0].repetition_penalty != 1


@pytest.mark.parametrize("context_length", [8, 24])
def test_the_warm_up_fits_a_short_context(tiny_model, context_length):
    core = EngineCore(config(tiny_model, page_size=4, context_length=context_length))
    assert core.warm_up() > 0
    assert core.runner.kv_pool.available_size() == core.runner.kv_pool.capacity



@pytest.mark.parametrize("page_size,kv_tokens", [(16, 48), (32, 64)])
def test_the_warm_up_fits_a_kv_pool_smaller_than_the_context(tiny_model, page_size, kv_tokens,
                                                             caplog):
    # the pool, not the 2,048-token context, bounds the prompts this worker takes
    core = EngineCore(config(tiny_model, page_size=page_size, kv_cache_tokens=kv_tokens,
                             chunked_prefill_size=page_size))
    sampled = []
    sample = core.sampler.sample

    def spy_sample(logits, rows, **kw):
        sampled.extend(r.params for r in rows)
        return sample(logits, rows, **kw)

    core.sampler.sample = spy_sample
    with caplog.at_level("WARNING", logger="radixpool.core"):
        assert core.warm_up() > 0
    assert "warm-up skipped" not in caplog.text
    assert any(p.temperature == 0 for p in sampled), "the greedy request did not run"
    assert any(p.temperature > 0 for p in sampled), "the sampling request did not run"
    assert core.runner.kv_pool.available_size() == core.runner.kv_pool.capacity

def test_a_fault_in_the_warm_up_stops_the_start_and_says_so(tiny_model, monkeypatch):
    def broken_forward(self, batch):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr("radixpool.worker.model_runner.ModelRunner.forward", broken_forward)
    front, core_end = socket.socketpair()
    run_core(config(tiny_model), core_end.detach(), parent_pid=0)
    inbox = Inbox(front)
    assert inbox.wait(5)
    (msg,) = inbox.read()
    assert isinstance(msg, CoreFailed), msg
    assert msg.error.startswith("warm-up failed: RuntimeError: no kernel image")


def test_without_warm_up_the_core_is_ready_at_once(tiny_model, monkeypatch):
    calls, readies = [], []
    monkeypatch.setattr(EngineCore, "warm_up", lambda self: calls.append(1) or 0)
    for warmup in (False, True):
        front, core_end = socket.socketpair()
        front.shutdown(socket.SHUT_WR)   # its loop sees the front end gone and returns
        run_core(config(tiny_model, warmup=warmup), core_end.detach(), parent_pid=0)
        readies += [m for m in Inbox(front).read() if isinstance(m, CoreReady)]
    assert calls == [1]   # only the second start warmed up
    assert len(readies) == 2 and readies[0].warmup_seconds == 0 < readies[1].warmup_seconds


def test_the_warm_up_builds_the_grammar_vocabulary_before_any_constrained_request(
        tiny_model, monkeypatch):
    import radixpool.worker.grammar.compiler as compiler_module
    from radixpool.worker.sampling_params import SamplingParams

    built = []
    load_vocab = compiler_module.load_vocab
    monkeypatch.setattr(compiler_module, "load_vocab",
                        lambda *a: built.append(1) or load_vocab(*a))
    core = EngineCore(config(tiny_model))
    core.warm_up()
    core.grammars.compiler._executor.submit(lambda: None).result(60)   # the compile thread idle
    assert built == [1], "the tokenizer's grammar view was not built during the warm-up"
    params = SamplingParams(max_new_tokens=4, temperature=0.0, regex="[ab]+")
    assert core.add_request(GenerateRequest("c", [5, 6, 7], params, seed=0)) is None
    tokens, finished = [], False
    while core.has_work:
        for delta in core.step().deltas:
            tokens += delta.token_ids
            finished |= delta.finished and delta.error is None
    assert finished and tokens and built == [1]   # served with the vocabulary built once
