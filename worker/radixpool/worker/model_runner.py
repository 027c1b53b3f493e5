"""The model runner: loads a checkpoint into our model, owns the KV memory, runs one step.

`ModelRunner(config)` resolves device and dtype, builds the model for the checkpoint's
architecture, loads its weights, creates the attention backend and allocates the KV pool and the
request→token table. `forward(batch)` computes one `ForwardBatch` and returns float32 logits for
`batch.logits_indices`. The caller (the scheduler) owns slot allocation and must have written
`req_to_token[row, prefix_len:seq_len] = out_cache_loc` for the step before calling `forward`.

KV cache size, in tokens:
- `kv_cache_tokens` when given;
- on GPU, `mem_fraction` (default 0.85) of the memory still free once the weights are loaded,
  less every per-request tensor (`mem/memory_plan.py`), reserved before the pool is sized;
- on CPU, min(4 × context_length, what fits in 2 GiB): enough for a few full-length requests
  without letting a large model's KV take the host's memory by surprise.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from radixpool.worker.attention.base import AttentionShape, create_backend
from radixpool.worker.config import EngineConfig
from radixpool.worker.forward_batch import ForwardBatch, forward_context
from radixpool.worker.mem.kv_pool import KVPool, ReqToTokenPool
from radixpool.worker.mem.memory_plan import PerRequestMemory, kv_tokens_for_memory
from radixpool.worker.model import CausalLM, load_checkpoint, model_spec

DEFAULT_GPU_MEM_FRACTION = 0.85
CPU_KV_CONTEXTS = 4
CPU_KV_BYTES = 2 << 30
# Rows of the request→token table beyond max_running_requests (requests being admitted or
# retracted while the running set is full).
SPARE_REQ_ROWS = 4
DEFAULT_ATTENTION_BACKEND = "torch"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def read_eos_token_ids(model_dir: str | Path, hf_config: Any) -> tuple[int, ...]:
    """EOS ids of config.json and generation_config.json together (each an int or a list)."""
    sources = [getattr(hf_config, "eos_token_id", None)]
    generation = Path(model_dir) / "generation_config.json"
    if generation.exists():
        sources.append(json.loads(generation.read_text()).get("eos_token_id"))
    ids: set[int] = set()
    for value in sources:
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return tuple(sorted(ids))


@contextmanager
def _default_tensor_placement(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoConfig

        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if not (Path(config.model_path) / "config.json").is_file():
            raise FileNotFoundError(f"model_path must be a local Hugging Face model directory "
                                    f"with config.json, got {config.model_path!r}")
        hf_config = AutoConfig.from_pretrained(config.model_path)
        self.spec = model_spec(hf_config)
        self.architecture = self.spec.architecture
        self.context_length = self._resolve_context_length(config.context_length)
        self.eos_token_ids = read_eos_token_ids(config.model_path, hf_config)

        self.attention_backend_name = (DEFAULT_ATTENTION_BACKEND if config.attention_backend
                                       == "auto" else config.attention_backend)
        shape = AttentionShape(self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim,
                               scale=self.spec.head_dim ** -0.5)
        self.attn_backend = create_backend(self.attention_backend_name, shape, self.device)
        with _default_tensor_placement(self.device, self.dtype):
            self.model = CausalLM(self.spec, self.attn_backend)
        load_checkpoint(self.model, config.model_path)
        self.model.eval()

        rows = config.max_running_requests + SPARE_REQ_ROWS
        # The sampler keeps penalty counts for at most `rows` requests (engine_core.py).
        self.per_request = PerRequestMemory(rows, self.context_length, self.vocab_size,
                                            penalty_rows=rows,
                                            max_batch=config.max_running_requests)
        kv_tokens = self._kv_cache_tokens()
        self.req_to_token_pool = ReqToTokenPool(rows, self.context_length, self.device)
        self.kv_pool = KVPool(kv_tokens, config.page_size, self.num_layers,
                              self.num_kv_heads, self.head_dim, self.dtype, self.device,
                              debug=config.debug_invariants)

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.spec.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    def _resolve_context_length(self, override: int | None) -> int:
        length = self.spec.max_position_embeddings
        if self.spec.sliding_window is not None:
            # The attention backends attend to the whole prefix; capping the context at the
            # window keeps that equal to what a sliding-window model computes.
            length = min(length, self.spec.sliding_window)
        if override is not None:
            if override > length:
                raise ValueError(f"context_length may only shrink the model's context "
                                 f"({length} tokens), got {override}")
            length = override
        return length

    def _kv_cache_tokens(self) -> int:
        cfg = self.config
        per_token = KVPool.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                           self.dtype)
        if cfg.kv_cache_tokens is not None:
            tokens = cfg.kv_cache_tokens
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            tokens = kv_tokens_for_memory(free, cfg.mem_fraction or DEFAULT_GPU_MEM_FRACTION,
                                          per_token, self.per_request, cfg.page_size)
        elif cfg.mem_fraction is not None:
            raise ValueError("mem_fraction sizes the KV cache from free GPU memory; "
                             "on CPU set kv_cache_tokens")
        else:
            tokens = min(CPU_KV_CONTEXTS * self.context_length, CPU_KV_BYTES // per_token)
        if tokens < cfg.page_size:
            raise ValueError(f"KV cache of {tokens} tokens is smaller than one page "
                             f"({cfg.page_size} tokens)")
        return tokens

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits `[len(batch.logits_indices), vocab_size]` for one step."""
        self.attn_backend.plan(batch)
        with forward_context(batch):
            hidden = self._run_model(batch)
            return self.model.compute_logits(hidden[batch.logits_indices]).float()

    def _run_model(self, batch: ForwardBatch) -> torch.Tensor:
        # Fixed-shape DECODE steps (CUDA graph replay, a later issue) will branch off here: a
        # captured graph per padded batch size, fed from the same batch.
        return self.model(batch.input_ids, batch.positions)

    def __repr__(self) -> str:
        return (f"ModelRunner({self.architecture}, device={self.device}, dtype={self.dtype}, "
                f"context={self.context_length}, kv_tokens={self.kv_pool.capacity}, "
                f"attention={self.attention_backend_name})")
