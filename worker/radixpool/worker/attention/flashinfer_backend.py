"""FlashInfer attention over the paged KV pool (GPU only; imported only when selected).

The pool's per-layer buffers `[(num_pages + 1) * page_size, kv_heads, head_dim]` are viewed as
FlashInfer's NHD paged layout `[num_pages + 1, page_size, kv_heads, head_dim]`, page 0 being the
pool's padding page. `plan` builds the step's page tables once (`paged_plan.plan_step`) and plans
one wrapper with them; every layer's `forward` writes its K/V into the pool and runs that wrapper:

- DECODE: `BatchDecodeWithPagedKVCacheWrapper` (tensor-core kernels when 4+ query heads share a
  KV head, where they beat the CUDA-core decode kernel);
- fresh prefill (no cached prefix in the batch): `BatchPrefillWithRaggedKVCacheWrapper`, causal,
  on the new K/V themselves;
- prefill over cached prefixes, chunks, mixed batches: `BatchPrefillWithPagedKVCacheWrapper`,
  causal over each request's whole sequence.

CUDA graphs: each captured decode size gets its own decode wrapper created with
`use_cuda_graph=True` over views of one set of fixed index buffers (sized for `max_batch`
requests of the full context); replaying a size re-plans its wrapper into those buffers.
"""

from __future__ import annotations

import torch

from radixpool.worker.attention.base import AttentionBackend, AttentionShape
from radixpool.worker.attention.paged_plan import PlanKind, StepPlan, plan_step
from radixpool.worker.forward_batch import ForwardBatch

try:
    import flashinfer
except ImportError as exc:  # the registry turns this into the user-facing error
    raise ImportError("the flashinfer attention backend needs the flashinfer-python package "
                      "(pip install flashinfer-python) on a CUDA machine") from exc

# FlashInfer's split-KV scratch space, shared by every wrapper (one kernel runs at a time).
WORKSPACE_BYTES = 256 << 20
TENSOR_CORE_DECODE_MIN_GROUP = 4


class FlashInferAttentionBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, shape: AttentionShape, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"attention_backend 'flashinfer' needs a CUDA device, got {device}; "
                             "use 'torch' on CPU")
        super().__init__(shape, device)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        group = shape.num_heads // shape.num_kv_heads
        self._tensor_cores = group >= TENSOR_CORE_DECODE_MIN_GROUP
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self._tensor_cores)
        self._paged_prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._ragged_prefill = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace,
                                                                               "NHD")
        self._graph_decode: dict[int, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def init_cuda_graph(self, max_batch: int, max_kv_pages: int) -> None:
        self._graph_buffers = (
            torch.zeros(max_batch + 1, dtype=torch.int32, device=self.device),  # indptr
            torch.zeros(max_kv_pages, dtype=torch.int32, device=self.device),   # indices
            torch.zeros(max_batch, dtype=torch.int32, device=self.device),      # last_page_len
        )

    def _graph_wrapper(self, size: int) -> flashinfer.BatchDecodeWithPagedKVCacheWrapper:
        wrapper = self._graph_decode.get(size)
        if wrapper is None:
            if self._graph_buffers is None:
                raise RuntimeError("init_cuda_graph() must run before a graph-sized batch")
            indptr, indices, last = self._graph_buffers
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._tensor_cores,
                paged_kv_indptr_buffer=indptr[:size + 1], paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last[:size])
            self._graph_decode[size] = wrapper
        return wrapper

    def plan(self, batch: ForwardBatch) -> None:
        s = self.shape
        page_size = batch.kv_pool.page_size
        dtype = batch.kv_pool.dtype
        step = plan_step(batch, page_size)
        if step.kind is PlanKind.DECODE:
            wrapper = (self._decode if batch.graph_size is None
                       else self._graph_wrapper(batch.graph_size))
            kv = step.kv
            wrapper.plan(kv.indptr, kv.indices, kv.last_page_len, s.num_heads, s.num_kv_heads,
                         s.head_dim, page_size, pos_encoding_mode="NONE", sm_scale=s.scale,
                         q_data_type=dtype, kv_data_type=dtype)
        elif step.kind is PlanKind.RAGGED_PREFILL:
            wrapper = self._ragged_prefill
            wrapper.plan(step.qo_indptr, step.qo_indptr, s.num_heads, s.num_kv_heads, s.head_dim,
                         causal=True, sm_scale=s.scale, q_data_type=dtype, kv_data_type=dtype)
        else:
            wrapper = self._paged_prefill
            kv = step.kv
            wrapper.plan(step.qo_indptr, kv.indptr, kv.indices, kv.last_page_len, s.num_heads,
                         s.num_kv_heads, s.head_dim, page_size, causal=True, sm_scale=s.scale,
                         q_data_type=dtype, kv_data_type=dtype)
        batch.attn_metadata = (step, wrapper)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        heads, kv_heads, dim = self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim
        pool = batch.kv_pool
        k_cache, v_cache = pool.k_buffers[layer_id], pool.v_buffers[layer_id]
        q = q.reshape(-1, heads, dim).to(k_cache.dtype)
        k = k.reshape(-1, kv_heads, dim).to(k_cache.dtype)
        v = v.reshape(-1, kv_heads, dim).to(v_cache.dtype)
        k_cache[batch.out_cache_loc] = k
        v_cache[batch.out_cache_loc] = v
        step: StepPlan
        step, wrapper = batch.attn_metadata
        if step.kind is PlanKind.RAGGED_PREFILL:
            out = wrapper.run(q, k, v)
        else:
            paged = (k_cache.view(-1, pool.page_size, kv_heads, dim),
                     v_cache.view(-1, pool.page_size, kv_heads, dim))
            out = wrapper.run(q, paged)
        return out.reshape(q.shape[0], heads * dim)
