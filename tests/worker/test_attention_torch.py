"""The torch paged attention backend equals plain dense causal attention over each request's
sequence, wherever its K/V live in the pool."""

from __future__ import annotations

import pytest
import torch

from radixpool.worker.attention.base import AttentionShape, backend_names, create_backend
from radixpool.worker.attention.torch_backend import ExtendSpan, PaddedExtendPlan, worth_padding
from radixpool.worker.forward_batch import ForwardBatch, ForwardMode
from radixpool.worker.mem.kv_pool import KVPool

HEAD_DIM = 8


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [n, heads, d] are the last n positions of a sequence whose k, v are [seq, kv_heads, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    n, seq = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    causal = torch.arange(seq)[None, :] <= torch.arange(seq - n, seq)[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)


class Setup:
    """A pool whose slots are handed out in scrambled order, and the K/V of every request."""

    def __init__(self, heads: int, kv_heads: int, page_size: int, seq_lens: list[int]) -> None:
        torch.manual_seed(0)
        self.shape = AttentionShape(heads, kv_heads, HEAD_DIM, scale=HEAD_DIM ** -0.5)
        self.backend = create_backend("torch", self.shape, torch.device("cpu"))
        self.pool = KVPool(512, page_size, 1, kv_heads, HEAD_DIM, torch.float32, "cpu")
        self.pool._free_pages = self.pool._free_pages[torch.randperm(self.pool.num_pages)]
        self.table = torch.zeros(len(seq_lens) + 1, 128, dtype=torch.int64)
        self.k = [torch.randn(n, kv_heads, HEAD_DIM) for n in seq_lens]
        self.v = [torch.randn(n, kv_heads, HEAD_DIM) for n in seq_lens]
        for row, n in enumerate(seq_lens):
            self.table[row, :n] = self.pool.alloc(n)

    def step(self, mode: ForwardMode, prefix_lens: list[int]) -> tuple[torch.Tensor, ...]:
        """Store the prefixes' K/V, then run the remaining tokens of each request in one step."""
        rows = list(range(len(self.k)))
        new_ids, slots, new_k, new_v = [], [], [], []
        for row, p in enumerate(prefix_lens):
            self.pool.k_buffers[0][self.table[row, :p]] = self.k[row][:p]
            self.pool.v_buffers[0][self.table[row, :p]] = self.v[row][:p]
            n = len(self.k[row])
            new_ids.append([0] * (n - p))
            slots.append(self.table[row, p:n])
            new_k.append(self.k[row][p:])
            new_v.append(self.v[row][p:])
        batch = ForwardBatch.build(mode, new_ids, prefix_lens, torch.cat(slots), rows,
                                   [True] * len(rows), self.table, self.pool)
        q = torch.randn(batch.num_tokens, self.shape.num_heads, HEAD_DIM)
        self.backend.plan(batch)
        self.plan = batch.attn_metadata
        out = self.backend.forward(q, torch.cat(new_k), torch.cat(new_v), 0, batch)
        expected = [dense_attention(qs, k, v, self.shape.scale) for qs, k, v in
                    zip(q.split(batch.extend_lens), self.k, self.v)]
        return out, torch.cat(expected)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_with_prefixes_equals_dense(heads, kv_heads, page_size):
    setup = Setup(heads, kv_heads, page_size, seq_lens=[1, 17, 40, 9])
    out, expected = setup.step(ForwardMode.EXTEND, prefix_lens=[0, 0, 23, 8])
    assert out.shape == (1 + 17 + 17 + 1, heads * HEAD_DIM)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_short_extends_run_in_one_padded_call_equal_to_dense(heads, kv_heads, page_size):
    # A verify step of exact jump-forward: a few new tokens on long prefixes, mixed lengths.
    setup = Setup(heads, kv_heads, page_size, seq_lens=[40, 3, 70, 21, 9])
    out, expected = setup.step(ForwardMode.EXTEND, prefix_lens=[33, 0, 69, 16, 8])
    assert isinstance(setup.plan, PaddedExtendPlan)
    assert out.shape == (7 + 3 + 1 + 5 + 1, heads * HEAD_DIM)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_long_uneven_extends_keep_a_call_per_request():
    setup = Setup(4, 2, 1, seq_lens=[1, 17, 40, 9])
    setup.step(ForwardMode.EXTEND, prefix_lens=[0, 0, 23, 8])
    assert isinstance(setup.plan, list) and all(isinstance(s, ExtendSpan) for s in setup.plan)


def test_padding_is_chosen_by_the_work_it_wastes():
    assert not worth_padding([5], [3])                      # one request: nothing to batch
    assert worth_padding([100, 0], [16, 1])                 # short extends batch like decode
    assert worth_padding([0, 0], [100, 90])                 # similar prefills: little padding
    assert not worth_padding([0, 0, 0], [2000, 20, 20])     # a long prompt beside short ones


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("page_size", [1, 4])
def test_batched_decode_equals_dense(heads, kv_heads, page_size):
    seq_lens = [1, 33, 5, 64]
    setup = Setup(heads, kv_heads, page_size, seq_lens)
    out, expected = setup.step(ForwardMode.DECODE, prefix_lens=[n - 1 for n in seq_lens])
    assert out.shape == (4, heads * HEAD_DIM)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_step_writes_new_kv_into_its_slots():
    setup = Setup(4, 2, 1, seq_lens=[6, 3])
    setup.step(ForwardMode.EXTEND, prefix_lens=[2, 0])
    for row, k in enumerate(setup.k):
        stored = setup.pool.k_buffers[0][setup.table[row, :len(k)]]
        assert torch.equal(stored, k)


def test_registry_names_the_torch_backend():
    assert "torch" in backend_names()
    with pytest.raises(ValueError, match=r"attention_backend must be one of .*torch.*got 'nope'"):
        create_backend("nope", AttentionShape(1, 1, 8, 1.0), torch.device("cpu"))
