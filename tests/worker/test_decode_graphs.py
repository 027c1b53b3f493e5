"""CUDA-graph decode: batch-size buckets, and padded steps that give the real lanes exactly what
the unpadded step gives them.

Capture is a parameter of `DecodeGraphs`; here it is the eager stand-in (`capture_eager`: the
same step function over the same static buffers, no graph), so the bucketing, the padding and the
static-buffer plumbing run on CPU. Capturing real graphs needs a GPU (not available here)."""

from __future__ import annotations

import itertools

import pytest
import torch
from model_driver import Driver

from radixpool.worker.config import EngineConfig
from radixpool.worker.decode_graphs import bucket_for, capture_eager, graph_batch_sizes
from radixpool.worker.model_runner import ModelRunner


def test_graph_sizes_cover_every_batch_up_to_the_maximum():
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256
    assert all(b - a <= 16 for a, b in itertools.pairwise(sizes))
    assert graph_batch_sizes(5) == (1, 2, 4, 5)
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    for n in range(1, 257):
        bucket = bucket_for(n, sizes)
        assert bucket >= n and bucket - n < max(16, n)   # at most 15 padded lanes above 16
    assert bucket_for(257, sizes) is None


@pytest.fixture(scope="module")
def runners(tiny_model_factory):
    def make(page_size: int) -> ModelRunner:
        path = tiny_model_factory("qwen3")
        return ModelRunner(EngineConfig(model_path=str(path), device="cpu", kv_cache_tokens=8192,
                                        page_size=page_size, max_running_requests=96))
    return {ps: make(ps) for ps in (1, 16)}


def prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(n)
    return [torch.randint(5, 1000, (int(length),), generator=gen).tolist()
            for length in torch.randint(1, 40, (n,), generator=gen)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_padded_decode_steps_equal_unpadded(runners, page_size):
    runner = runners[page_size]
    driver = Driver(runner)
    runner.decode_graphs = None
    # Batches of 3, 5 and 9 requests: padded to 4 and 8, and one above the largest size (eager).
    groups = [prompts(n) for n in (3, 5, 9)]
    eager = [driver.greedy(p, max_new_tokens=6) for p in groups]
    eager_logits = []
    for p in groups:
        seqs = [driver.new_seq() for _ in p]
        first = driver.extend(seqs, p).argmax(-1).tolist()
        eager_logits.append(driver.decode(seqs, first))

    graphs = runner.init_decode_graphs((1, 2, 4, 8), capture_eager)
    replayed = []
    original_run = graphs.run
    graphs.run = lambda batch: replayed.append(len(batch.prefix_lens)) or original_run(batch)
    try:
        assert [driver.greedy(p, max_new_tokens=6) for p in groups] == eager
        for p, expected in zip(groups, eager_logits):
            seqs = [driver.new_seq() for _ in p]
            first = driver.extend(seqs, p).argmax(-1).tolist()
            torch.testing.assert_close(driver.decode(seqs, first), expected, atol=1e-5, rtol=0)
    finally:
        runner.decode_graphs = None
    # the batches of 3 and 5 went through the padded path, the batch of 9 did not
    assert set(replayed) == {3, 5}


def test_padded_lanes_write_only_the_padding_slot(runners):
    runner = runners[16]
    driver = Driver(runner)
    seqs = [driver.new_seq() for _ in range(3)]
    first = driver.extend(seqs, prompts(3)).argmax(-1).tolist()
    for k in runner.kv_pool.k_buffers:
        k[runner.padding.slot] = 7.0   # a sentinel the padded lanes overwrite
    k_before = [k.clone() for k in runner.kv_pool.k_buffers]
    runner.init_decode_graphs((8,), capture_eager)
    try:
        driver.decode(seqs, first)
    finally:
        runner.decode_graphs = None
    written = set(runner.req_to_token_pool.table[[s.row for s in seqs],
                                                 [len(s.ids) - 1 for s in seqs]].tolist())
    for before, after in zip(k_before, runner.kv_pool.k_buffers):
        changed = set((before != after).any(-1).any(-1).nonzero().flatten().tolist())
        assert changed <= written | {runner.padding.slot}
        assert runner.padding.slot in changed   # five padded lanes wrote there


def test_disable_cuda_graph_flag(tmp_path):
    import argparse

    from radixpool.worker.server.config import add_worker_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    on = config_from_args(parser.parse_args(["--model", str(tmp_path)]))
    off = config_from_args(parser.parse_args(["--model", str(tmp_path), "--disable-cuda-graph",
                                              "--attention-backend", "flashinfer"]))
    assert on.engine.cuda_graph and not off.engine.cuda_graph
    assert off.engine.attention_backend == "flashinfer"
