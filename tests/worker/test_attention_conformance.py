"""Every registered attention backend computes the same attention as a dense reference, on the
cases a serving step produces: fresh prefill, prefill over cached (radix-shared) prefixes and
unaligned chunks, decode, mixed batches, page sizes 1 and 16, decode batches padded to a
CUDA-graph size.

On CPU the torch backend runs every case; backends that need a GPU are skipped, saying why, and
their index building (`paged_plan`) is checked as pure functions on the same cases: the pages a
paged kernel is given must reconstruct exactly each request's KV slots.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from radixpool.worker.attention.base import AttentionShape, backend_names, create_backend
from radixpool.worker.attention.paged_plan import PagedKV, PlanKind, plan_step
from radixpool.worker.decode_graphs import Padding, StaticDecodeInputs, bucket_for
from radixpool.worker.forward_batch import ForwardBatch, ForwardMode
from radixpool.worker.mem.kv_pool import KVPool

HEAD_DIM = 64
GPU_BACKENDS = {"flashinfer"}


@dataclass(frozen=True)
class Request:
    prefix: int                  # tokens already in the pool
    extend: int                  # new tokens this step
    shares: int | None = None    # request whose first `prefix` tokens (whole pages) it reuses


CASES = {
    "fresh_prefill": (ForwardMode.EXTEND, [Request(0, 1), Request(0, 37), Request(0, 70)]),
    "cached_prefixes": (ForwardMode.EXTEND, [Request(48, 20), Request(32, 5, shares=0),
                                             Request(0, 9), Request(48, 1, shares=0)]),
    "unaligned_chunk": (ForwardMode.EXTEND, [Request(21, 30), Request(3, 14)]),
    "mixed_prefill_decode": (ForwardMode.EXTEND, [Request(40, 1), Request(0, 25),
                                                  Request(17, 1), Request(32, 12, shares=0)]),
    "decode": (ForwardMode.DECODE, [Request(0, 1), Request(15, 1), Request(16, 1),
                                    Request(99, 1), Request(64, 1, shares=3)]),
    # Past one kernel tile (128 queries or keys): causal masks that cross tile boundaries.
    "long_fresh_prefill": (ForwardMode.EXTEND, [Request(0, 300), Request(0, 150)]),
    "long_cached_prefix": (ForwardMode.EXTEND, [Request(160, 200), Request(144, 130, shares=0),
                                                Request(300, 1)]),
    "long_decode": (ForwardMode.DECODE, [Request(450, 1), Request(129, 1),
                                         Request(400, 1, shares=0)]),
}


def backend_device(name: str) -> torch.device:
    if name not in GPU_BACKENDS:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        pytest.skip(f"the {name} backend needs a CUDA GPU (none here); its index building is "
                    f"tested below as pure functions")
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"the {name} backend needs the {name} package, not installed here")
    return torch.device("cuda")


class Step:
    """A pool whose pages are handed out in scrambled order, requests laid out in it the way the
    scheduler does (`alloc_extend`, shared prefixes as copied table rows), and one step's batch."""

    def __init__(self, mode: ForwardMode, reqs: list[Request], page_size: int,
                 heads: int, kv_heads: int, dtype: torch.dtype, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(7)
        self.shape = AttentionShape(heads, kv_heads, HEAD_DIM, scale=HEAD_DIM ** -0.5)
        pool = KVPool(2048, page_size, 1, kv_heads, HEAD_DIM, dtype, device)
        pool._free_pages = pool._free_pages[torch.randperm(pool.num_pages, generator=gen)
                                            .to(device)]
        table = torch.zeros(len(reqs) + 2, 512, dtype=torch.int64, device=device)
        slots = []
        for row, r in enumerate(reqs):
            if r.shares is not None:
                assert r.prefix % page_size == 0, "the radix cache shares whole pages only"
                table[row, :r.prefix] = table[r.shares, :r.prefix]
            elif r.prefix:
                table[row, :r.prefix] = pool.alloc_extend([0], [r.prefix], [0])
            last = int(table[row, r.prefix - 1]) if r.prefix else 0
            new = pool.alloc_extend([r.prefix], [r.extend], [last])
            table[row, r.prefix:r.prefix + r.extend] = new
            slots.append(new)
        # The prefixes' K/V are already in the pool (random, as a previous step left them).
        pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen))
        pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen))
        self.pool, self.table, self.reqs = pool, table, reqs
        self.batch = ForwardBatch.build(mode, [[5] * r.extend for r in reqs],
                                        [r.prefix for r in reqs], torch.cat(slots),
                                        list(range(len(reqs))), [True] * len(reqs), table, pool)
        n = self.batch.num_tokens
        self.q = torch.randn(n, heads, HEAD_DIM, generator=gen).to(device, dtype)
        self.k = torch.randn(n, kv_heads, HEAD_DIM, generator=gen).to(device, dtype)
        self.v = torch.randn(n, kv_heads, HEAD_DIM, generator=gen).to(device, dtype)

    def expected(self) -> torch.Tensor:
        """Dense causal attention of each request over its prefix (from the pool) + new K/V."""
        outs, start = [], 0
        k_pool, v_pool = self.pool.k_buffers[0].float(), self.pool.v_buffers[0].float()
        for row, r in enumerate(self.reqs):
            end = start + r.extend
            prefix_slots = self.table[row, :r.prefix]
            k = torch.cat([k_pool[prefix_slots], self.k[start:end].float()])
            v = torch.cat([v_pool[prefix_slots], self.v[start:end].float()])
            outs.append(dense_attention(self.q[start:end].float(), k, v, self.shape.scale))
            start = end
        return torch.cat(outs)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [n, heads, d] are the last n positions of a sequence whose k, v are [seq, kv_heads, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    n, seq = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    causal = torch.arange(seq, device=q.device)[None, :] <= torch.arange(seq - n, seq,
                                                                        device=q.device)[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2,
                                                                        "rtol": 2e-2}


def run_backend(name: str, step: Step, device: torch.device, batch: ForwardBatch,
                q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    backend = create_backend(name, step.shape, device)
    if batch.graph_size is not None and backend.supports_cuda_graph:
        backend.init_cuda_graph(batch.graph_size, 4096)
    backend.plan(batch)
    return backend.forward(q, k, v, 0, batch)


@pytest.mark.parametrize("backend", backend_names())
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)])
def test_backend_matches_dense_attention(backend, case, page_size, heads, kv_heads):
    device = backend_device(backend)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    mode, reqs = CASES[case]
    step = Step(mode, reqs, page_size, heads, kv_heads, dtype, device)
    expected = step.expected()
    out = run_backend(backend, step, device, step.batch, step.q, step.k, step.v)
    assert out.shape == (step.batch.num_tokens, heads * HEAD_DIM)
    torch.testing.assert_close(out.float(), expected, **tolerance(dtype))
    # the step's K/V were written where the scheduler put them
    assert torch.equal(step.pool.k_buffers[0][step.batch.out_cache_loc], step.k)


@pytest.mark.parametrize("backend", backend_names())
@pytest.mark.parametrize("case", CASES)
def test_stale_slots_past_a_request_do_not_leak_into_it(backend, case):
    # Past a request's length its table row still names slots of the row's earlier requests.
    # One of those ended with NaN K/V (a poisoned embedding) and its slots were freed with the
    # NaN in them: a masked column weighs 0, but 0 x NaN is NaN. The torch backend read them
    # for every shorter row of a decode or padded batch, and a request beside the poisoned one
    # got NaN logits too (aborted as non-finite, on CPU, in 1 CI run of many).
    device = backend_device(backend)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    mode, reqs = CASES[case]
    step = Step(mode, reqs, 1, 8, 2, dtype, device)
    stale = int(step.pool._free_pages[0])      # a free slot (page size 1), poisoned
    step.pool.k_buffers[0][stale] = float("nan")
    step.pool.v_buffers[0][stale] = float("nan")
    for row, r in enumerate(reqs):
        step.table[row, r.prefix + r.extend:] = stale
    out = run_backend(backend, step, device, step.batch, step.q, step.k, step.v)
    torch.testing.assert_close(out.float(), step.expected(), **tolerance(dtype))


@pytest.mark.parametrize("backend", backend_names())
@pytest.mark.parametrize("page_size", [1, 16])
def test_padded_decode_lanes_leave_real_lanes_unchanged(backend, page_size):
    """A decode batch padded to a CUDA-graph size: the real lanes equal the dense reference,
    and the padded lanes wrote only the pool's padding slot."""
    device = backend_device(backend)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    mode, reqs = CASES["decode"]
    step = Step(mode, reqs, page_size, 8, 2, dtype, device)
    expected = step.expected()
    n, size = len(reqs), bucket_for(len(reqs), (1, 2, 4, 8))
    padding = Padding(row=0, slot=0)
    inputs = StaticDecodeInputs(size, 16, dtype, device)
    inputs.fill(step.batch, size, padding)
    padded = inputs.batch(step.batch, size)
    before = step.pool.k_buffers[0].clone()

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.full((size - n, *t.shape[1:]), 9.0, dtype=dtype,
                                        device=device)])

    out = run_backend(backend, step, device, padded, pad(step.q), pad(step.k), pad(step.v))
    assert out.shape == (size, 8 * HEAD_DIM)
    torch.testing.assert_close(out[:n].float(), expected, **tolerance(dtype))
    changed = (step.pool.k_buffers[0] != before).any(-1).any(-1).nonzero().flatten()
    assert set(changed.tolist()) <= set(step.batch.out_cache_loc.tolist()) | {padding.slot}


# ------------------------------------------------------------ paged index building (pure)
def slots_from_pages(kv: PagedKV, request: int, page_size: int) -> torch.Tensor:
    """The KV slots a paged kernel reads for one request, from its page table."""
    start, end = int(kv.indptr[request]), int(kv.indptr[request + 1])
    pages = kv.indices[start:end].to(torch.int64)
    slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()
    return slots[:(end - start - 1) * page_size + int(kv.last_page_len[request])]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_page_tables_reconstruct_each_requests_kv_slots(case, page_size):
    mode, reqs = CASES[case]
    step = Step(mode, reqs, page_size, 4, 2, torch.float32, torch.device("cpu"))
    plan = plan_step(step.batch, page_size)
    assert plan.qo_indptr.tolist() == [sum(r.extend for r in reqs[:i])
                                       for i in range(len(reqs) + 1)]
    if not any(r.prefix for r in reqs):
        assert plan.kind is PlanKind.RAGGED_PREFILL and plan.kv is None
        return
    assert plan.kind is (PlanKind.DECODE if mode is ForwardMode.DECODE
                         else PlanKind.PAGED_PREFILL)
    assert plan.kv.indices.dtype == plan.kv.indptr.dtype == torch.int32
    assert plan.kv.indptr.device.type == "cpu"    # the kernels' planners read it on the host
    for i, r in enumerate(reqs):
        kv_len = r.prefix + r.extend
        assert 1 <= int(plan.kv.last_page_len[i]) <= page_size
        assert torch.equal(slots_from_pages(plan.kv, i, page_size), step.table[i, :kv_len])


def test_padded_lanes_get_one_page_each():
    mode, reqs = CASES["decode"]
    step = Step(mode, reqs, 16, 4, 2, torch.float32, torch.device("cpu"))
    inputs = StaticDecodeInputs(8, 16, torch.float32, torch.device("cpu"))
    inputs.fill(step.batch, 8, Padding(row=0, slot=0))
    plan = plan_step(inputs.batch(step.batch, 8), 16)
    pages = (plan.kv.indptr[1:] - plan.kv.indptr[:-1]).tolist()
    assert pages[len(reqs):] == [1, 1, 1]
    assert plan.kv.last_page_len.tolist()[len(reqs):] == [1, 1, 1]
    assert inputs.out_cache_loc[len(reqs):].tolist() == [0, 0, 0]


# ------------------------------------------------------------ FlashInfer on a CPU machine
def test_flashinfer_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.delitem(sys.modules, "radixpool.worker.attention.flashinfer_backend",
                        raising=False)
    with pytest.raises(ImportError, match="pip install flashinfer-python"):
        create_backend("flashinfer", AttentionShape(8, 2, 64, 0.125), torch.device("cuda"))


def test_flashinfer_on_cpu_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.delitem(sys.modules, "radixpool.worker.attention.flashinfer_backend",
                        raising=False)
    with pytest.raises(ValueError, match=r"'flashinfer' needs a CUDA device.*use 'torch'"):
        create_backend("flashinfer", AttentionShape(8, 2, 64, 0.125), torch.device("cpu"))


def test_importing_the_engine_does_not_import_flashinfer():
    import subprocess

    code = ("import sys, radixpool.worker.model_runner, radixpool.worker.attention; "
            "assert 'flashinfer' not in sys.modules, 'flashinfer imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_auto_takes_flashinfer_on_a_gpu_where_it_serves_the_model(monkeypatch, caplog):
    """`auto` on a GPU is the fast path (FlashInfer, CUDA graphs) when it can run; otherwise the
    torch reference, with a warning naming why. A GPU pool with the default engine settings ran
    the reference path, with no CUDA graphs, although its image carries FlashInfer."""
    import importlib.util

    from radixpool.worker.model_runner import resolve_attention_backend

    installed = importlib.machinery.ModuleSpec("flashinfer", None)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: installed if name == "flashinfer" else None)
    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    assert resolve_attention_backend("auto", cuda, bf16, 128) == "flashinfer"
    assert resolve_attention_backend("auto", cuda, torch.float16, 64) == "flashinfer"
    assert resolve_attention_backend("auto", cpu, bf16, 128) == "torch"
    assert resolve_attention_backend("torch", cuda, bf16, 128) == "torch"
    assert resolve_attention_backend("flashinfer", cuda, torch.float32, 96) == "flashinfer"
    with caplog.at_level("WARNING"):
        assert resolve_attention_backend("auto", cuda, torch.float32, 128) == "torch"
        assert resolve_attention_backend("auto", cuda, bf16, 96) == "torch"
    assert "not float32" in caplog.text and "head dim 96" in caplog.text

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert resolve_attention_backend("auto", cuda, bf16, 128) == "torch"
    assert "flashinfer-python package is not installed" in caplog.text
