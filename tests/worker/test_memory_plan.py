"""GPU memory: every per-request tensor is reserved before the KV pool takes its fraction.

The sizing is a pure function (tested here on CPU); the penalty counts never grow past the rows
it reserved, so a full batch cannot run out of memory after the KV cache took its share."""

from __future__ import annotations

import pytest
import torch

from radixpool.worker.mem.memory_plan import PerRequestMemory, kv_tokens_for_memory
from radixpool.worker.penalties import PenaltyState

GIB = 1 << 30
PER_TOKEN = 2 * 32 * 8 * 128 * 2   # a 32-layer, 8-KV-head, bf16 model: 128 KiB per token


def plan(rows=260, context=32768, vocab=152_064, max_batch=256) -> PerRequestMemory:
    return PerRequestMemory(rows, context, vocab, penalty_rows=rows, max_batch=max_batch)


def test_kv_gets_the_fraction_less_every_per_request_tensor():
    per_request = plan()
    tokens = kv_tokens_for_memory(60 * GIB, 0.85, PER_TOKEN, per_request, page_size=16)
    assert tokens % 16 == 0
    static = int(60 * GIB * 0.85)
    assert tokens * PER_TOKEN + per_request.total_bytes <= static
    assert static - (tokens * PER_TOKEN + per_request.total_bytes) < 16 * PER_TOKEN
    # the table, the penalty counts and a full batch's sampler buffers are all in it
    assert per_request.table_bytes == 260 * 32768 * 8
    assert per_request.penalty_bytes == 260 * 152_064 * 5
    assert per_request.sampler_bytes >= 256 * 152_064 * 4


def test_more_running_requests_leave_less_kv():
    small = kv_tokens_for_memory(60 * GIB, 0.85, PER_TOKEN, plan(rows=68, max_batch=64), 1)
    large = kv_tokens_for_memory(60 * GIB, 0.85, PER_TOKEN, plan(rows=516, max_batch=512), 1)
    diff_bytes = plan(rows=516, max_batch=512).total_bytes - plan(rows=68, max_batch=64).total_bytes
    assert small - large == pytest.approx(diff_bytes / PER_TOKEN, abs=1)


def test_no_room_for_kv_is_a_clear_error():
    with pytest.raises(ValueError, match=r"mem_fraction 0\.1 .* max_running_requests"):
        kv_tokens_for_memory(2 * GIB, 0.1, PER_TOKEN, plan(), 16)


def test_penalty_counts_never_grow_past_the_reserved_rows():
    state = PenaltyState(64, torch.device("cpu"), max_requests=5)
    logits = torch.zeros(1, 64)
    factors = torch.tensor([[1.1, 0.1, 0.1]])
    for i in range(40):   # 40 requests one after another, never more than one at a time
        state.apply(logits, [0], [f"r{i}"], [[1, 2, 3]], [[4, i % 60]], factors)
        assert state._counts.shape[0] <= 5


def test_preallocated_penalty_counts_are_all_there_up_front():
    state = PenaltyState(64, torch.device("cpu"), max_requests=7, preallocate=True)
    assert state._counts.shape == (7, 64)
    logits = torch.zeros(1, 64)
    for i in range(20):
        state.apply(logits, [0], [f"r{i}"], [[1]], [[2]], torch.tensor([[1.1, 0.0, 0.0]]))
    assert state._counts.shape == (7, 64)
