"""The model runner: loads a checkpoint into our model, owns the KV memory, runs one step.

`ModelRunner(config)` resolves device and dtype, builds the model for the checkpoint's
architecture, loads its weights, creates the attention backend and allocates the KV pool and the
request→token table. `forward(batch)` computes one `ForwardBatch` and returns float32 logits for
`batch.logits_indices`. The caller (the scheduler) owns slot allocation and must have written
`req_to_token[row, prefix_len:seq_len] = out_cache_loc` for the step before calling `forward`.

KV cache size, in tokens:
- `kv_cache_tokens` when given (on GPU, refused at start when it leaves no room for those
  tensors, activations and graphs: `check_kv_tokens_fit`);
- on GPU, `mem_fraction` (default 0.85) of the memory still free once the weights are loaded,
  less every per-request tensor, the largest step's activations and the CUDA graphs
  (`mem/memory_plan.py`), all reserved before the pool is sized;
- on CPU, min(4 × context_length, what fits in 2 GiB): enough for a few full-length requests
  without letting a large model's KV take the host's memory by surprise; less in a container
  whose memory limit (or a host whose available memory) does not hold that beside the per-request
  tensors and activations (`cpu_kv_tokens`), and a `kv_cache_tokens` that does not fit there is
  refused (the pool's pages are touched only as the cache fills: it would start, and the worker
  be killed for memory later).

Weights are allocated on the target device and filled tensor by tensor from the safetensors
files (`model/loader.py`): the host never holds more than one checkpoint tensor. Running out of
memory at start-up is an error that names what did not fit (weights, KV cache, graphs).
`random_weights` skips the checkpoint (benchmarks of real configurations, `model/
reference_configs.py`).

Decode steps replay CUDA graphs (`decode_graphs.py`) on a GPU whose attention backend supports
them, unless `cuda_graph` is off.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from radixpool.tokenization import PromptTokenizer
from radixpool.worker.attention.base import AttentionShape, create_backend
from radixpool.worker.config import EngineConfig
from radixpool.worker.decode_graphs import (
    DEFAULT_MAX_GRAPH_BATCH,
    Capture,
    CudaGraphCapture,
    DecodeGraphs,
    Padding,
    StaticDecodeInputs,
    graph_batch_sizes,
)
from radixpool.worker.forward_batch import ForwardBatch, ForwardMode, forward_context
from radixpool.worker.mem.kv_pool import KVPool, ReqToTokenPool
from radixpool.worker.mem.memory_plan import (
    GIB,
    ModelShape,
    PerRequestMemory,
    StepMemory,
    check_kv_tokens_fit,
    check_weights_fit,
    cpu_kv_tokens,
    host_memory,
    kv_tokens_for_memory,
)
from radixpool.worker.model import CausalLM, ModelSpec, load_checkpoint, model_spec
from radixpool.worker.sampling_params import MODEL_SAMPLING_FIELDS, SamplingParams

log = logging.getLogger(__name__)

DEFAULT_GPU_MEM_FRACTION = 0.85
CPU_KV_CONTEXTS = 4
CPU_KV_BYTES = 2 << 30
# Rows of the request→token table beyond max_running_requests (requests being admitted or
# retracted while the running set is full).
SPARE_REQ_ROWS = 4
# `attention_backend="auto"` takes FlashInfer where it is known to run (the GPU tests: bf16, head
# dims 64 and 128, page sizes 1 and 16, on an H100 and an H200), the torch reference elsewhere.
FLASHINFER_HEAD_DIMS = (64, 128)
FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)

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


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                              head_dim: int) -> str:
    """`auto` is `flashinfer` on a CUDA device when the flashinfer-python package is installed
    and the model's dtype and head dim are ones FlashInfer serves; else `torch`, with a warning
    on a GPU (the reference path: no CUDA graphs, and decode copies each request's KV)."""
    if name != "auto":
        return name
    if device.type != "cuda":
        return "torch"
    reason = None
    if importlib.util.find_spec("flashinfer") is None:
        reason = "the flashinfer-python package is not installed"
    elif dtype not in FLASHINFER_DTYPES:
        reason = f"FlashInfer serves bfloat16 and float16, not {str(dtype).removeprefix('torch.')}"
    elif head_dim not in FLASHINFER_HEAD_DIMS:
        reason = (f"head dim {head_dim} is not one FlashInfer was tested with here "
                  f"{FLASHINFER_HEAD_DIMS} (--attention-backend flashinfer tries it)")
    if reason is None:
        return "flashinfer"
    log.warning("attention backend auto: torch, the slow reference path, on a GPU because %s",
                reason)
    return "torch"


def model_shape(spec: ModelSpec, dtype: torch.dtype) -> ModelShape:
    return ModelShape(spec.vocab_size, spec.hidden_size, spec.intermediate_size, spec.num_layers,
                      spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim,
                      spec.tie_word_embeddings, torch.empty((), dtype=dtype).element_size())


def read_eos_token_ids(model_dir: str | Path, hf_config: Any) -> tuple[int, ...]:
    """EOS ids of config.json, generation_config.json (each an int or a list) and the
    tokenizer's `eos_token` together. The tokenizer's counts because chat fine-tunes set it to
    their end-of-turn token (`<|im_end|>`, `<|eot_id|>`) and often leave the configs with the
    base model's; vLLM and SGLang stop on it too."""
    sources = [getattr(hf_config, "eos_token_id", None)]
    generation = Path(model_dir) / "generation_config.json"
    if generation.exists():
        sources.append(json.loads(generation.read_text()).get("eos_token_id"))
    if (Path(model_dir) / "tokenizer.json").is_file():
        sources.append(PromptTokenizer.from_dir(model_dir).eos_token_id)
    ids: set[int] = set()
    for value in sources:
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return tuple(sorted(ids))


def read_sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The sampling fields of `MODEL_SAMPLING_FIELDS` that generation_config.json sets: what a
    request leaving them out gets (as in vLLM and SGLang). ValueError naming the file when one
    is out of range, so the worker does not start and refuse every request."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    doc = json.loads(path.read_text())
    defaults = {name: doc[name] for name in MODEL_SAMPLING_FIELDS if doc.get(name) is not None}
    try:
        SamplingParams.from_dict(defaults)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    return defaults


@contextmanager
def _default_tensor_placement(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def _fill_random(model: torch.nn.Module, std: float = 0.02) -> None:
    """Norm scales 1, everything else N(0, std): activations stay in range over many layers."""
    generator = torch.Generator(next(model.parameters()).device).manual_seed(0)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)


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
        self.eos_token_ids = read_eos_token_ids(config.model_path, hf_config)
        self.sampling_defaults = read_sampling_defaults(config.model_path)
        if self.sampling_defaults:
            log.info("sampling defaults from generation_config.json: %s", self.sampling_defaults)

        self.attention_backend_name = resolve_attention_backend(
            config.attention_backend, self.device, self.dtype, self.spec.head_dim)
        log.info("attention backend: %s", self.attention_backend_name)
        shape = AttentionShape(self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim,
                               scale=self.spec.head_dim ** -0.5,
                               sliding_window=(self.spec.sliding_window
                                               if self.spec.window_in_every_layer else None))
        self.attn_backend = create_backend(self.attention_backend_name, shape, self.device)
        self.context_length = self._resolve_context_length(config.context_length)
        self.shape = model_shape(self.spec, self.dtype)
        self._load_model()

        rows = config.max_running_requests + SPARE_REQ_ROWS
        # The sampler keeps penalty counts for at most `rows` requests (engine_core.py).
        self.per_request = PerRequestMemory(rows, self.context_length, self.vocab_size,
                                            penalty_rows=rows,
                                            max_batch=config.max_running_requests)
        use_graphs = (self.device.type == "cuda" and config.cuda_graph
                      and self.attn_backend.supports_cuda_graph)
        if self.device.type == "cuda" and config.cuda_graph and not use_graphs:
            log.info("decode CUDA graphs off: attention backend %r cannot be captured",
                     self.attention_backend_name)
        graph_batch = min(config.max_running_requests, DEFAULT_MAX_GRAPH_BATCH)
        # a step computes up to max_prefill_tokens, or a token of each running request when
        # more than that many decode (no prompt tokens then)
        self.step_memory = StepMemory(self.shape,
                                      max(config.max_prefill_tokens, config.max_running_requests),
                                      config.max_running_requests,
                                      graph_batch if use_graphs else 0,
                                      graph_batch * self.pages_per_context if use_graphs else 0)
        kv_tokens = self._kv_cache_tokens()
        self.req_to_token_pool = ReqToTokenPool(rows, self.context_length, self.device)
        try:
            self.kv_pool = KVPool(kv_tokens, config.page_size, self.num_layers,
                                  self.num_kv_heads, self.head_dim, self.dtype, self.device,
                                  debug=config.debug_invariants)
        except torch.OutOfMemoryError:
            raise MemoryError(f"the KV cache ({kv_tokens} tokens) did not fit on {self.device}: "
                              f"lower kv_cache_tokens or mem_fraction") from None
        # Padded decode lanes write slot 0 (the pool's padding page) and read row 0's first slot.
        self.padding = Padding(row=0, slot=0)
        self.decode_graphs: DecodeGraphs | None = None
        if use_graphs:
            self._capture_decode_graphs(graph_batch)

    def _load_model(self) -> None:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            check_weights_fit(self.shape.weight_bytes, free, str(self.device))
        elif (host := host_memory()) is not None:
            check_weights_fit(self.shape.weight_bytes, host.free_bytes, f"the CPU ({host.bound})")
        try:
            with _default_tensor_placement(self.device, self.dtype):
                self.model = CausalLM(self.spec, self.attn_backend)
            if self.config.random_weights:
                _fill_random(self.model)
            else:
                load_checkpoint(self.model, self.config.model_path)
        except torch.OutOfMemoryError:
            raise MemoryError(f"the model's weights ({self.shape.weight_bytes / GIB:.2f} GiB) "
                              f"did not fit on {self.device}") from None
        self.model.eval()

    def init_decode_graphs(self, sizes: tuple[int, ...], capture: Capture) -> DecodeGraphs:
        """Capture (or, with an eager `capture`, prepare) the decode steps of `sizes`; decode
        batches up to `max(sizes)` then run through them."""
        max_batch = max(sizes)
        self.attn_backend.init_cuda_graph(max_batch, max_batch * self.pages_per_context)
        inputs = StaticDecodeInputs(max_batch, self.spec.hidden_size, self.dtype, self.device)
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        template = ForwardBatch(ForwardMode.DECODE, empty, empty, empty, empty, empty, [], [],
                                empty, self.req_to_token_pool.table, self.kv_pool)
        with torch.inference_mode():
            self.decode_graphs = DecodeGraphs(self.model, self.attn_backend, sizes, self.padding,
                                              inputs, template, capture)
        return self.decode_graphs

    def _capture_decode_graphs(self, max_batch: int) -> None:
        sizes = graph_batch_sizes(max_batch)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        try:
            graphs = self.init_decode_graphs(sizes, CudaGraphCapture())
        except torch.OutOfMemoryError:
            raise MemoryError(f"capturing decode CUDA graphs (batch sizes up to {max_batch}, "
                              f"{self.step_memory.graph_bytes / GIB:.2f} GiB reserved) ran out "
                              f"of memory: pass --disable-cuda-graph or lower mem_fraction / "
                              f"max_running_requests") from None
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        log.info("captured %d decode CUDA graphs (batch sizes %s..%s) in %.1f s using %.2f GiB "
                 "(%.2f GiB reserved)", len(sizes), sizes[0], sizes[-1], graphs.capture_seconds,
                 used / GIB, self.step_memory.graph_bytes / GIB)

    @property
    def pages_per_context(self) -> int:
        return -(-self.context_length // self.config.page_size)

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
        length, source = self.spec.max_position_embeddings, "max_position_embeddings"
        yarn = self.spec.yarn_context
        if yarn is not None and yarn > length:
            length, source = yarn, "rope_scaling factor × original_max_position_embeddings"
        window = self.spec.sliding_window
        if not self.spec.window_in_every_layer:
            why = "only some layers use the window (max_window_layers)"
        else:
            why = f"the {self.attention_backend_name} attention backend has no window"
        if window is not None and window < length and (
                not self.spec.window_in_every_layer
                or not self.attn_backend.supports_sliding_window):
            # Where the backend attends to the whole prefix, capping the context at the window
            # keeps that equal to what a sliding-window model computes.
            length = window
            source = f"sliding_window ({why})"
            if override is None:
                log.warning("context length capped at config.json sliding_window, %d tokens "
                            "(max_position_embeddings %d): %s", window,
                            self.spec.max_position_embeddings, why)
        if override is not None:
            if override > length:
                raise ValueError(f"context_length may only shrink the model's context "
                                 f"({length} tokens: config.json {source}), got {override}")
            length = override
        return length

    def _kv_cache_tokens(self) -> int:
        cfg = self.config
        per_token = KVPool.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                           self.dtype)
        host = host_memory() if self.device.type == "cpu" else None
        if cfg.kv_cache_tokens is not None:
            tokens = cfg.kv_cache_tokens
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                check_kv_tokens_fit(tokens, free, per_token, self.per_request, cfg.page_size,
                                    self.step_memory)
            elif host is not None:
                check_kv_tokens_fit(tokens, host.free_bytes, per_token, self.per_request,
                                    cfg.page_size, self.step_memory, host)
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            tokens = kv_tokens_for_memory(free, cfg.mem_fraction or DEFAULT_GPU_MEM_FRACTION,
                                          per_token, self.per_request, cfg.page_size,
                                          self.step_memory)
        elif cfg.mem_fraction is not None:
            raise ValueError("mem_fraction sizes the KV cache from free GPU memory; "
                             "on CPU set kv_cache_tokens")
        else:
            tokens = min(CPU_KV_CONTEXTS * self.context_length, CPU_KV_BYTES // per_token)
            if host is not None:
                fits = cpu_kv_tokens(tokens, host, per_token, self.per_request, cfg.page_size,
                                     self.step_memory)
                if fits < tokens:
                    log.warning("KV cache of %d tokens (not the default %d): what fits in %s",
                                fits, tokens, host.bound)
                tokens = fits
        if tokens < cfg.page_size:
            raise ValueError(f"KV cache of {tokens} tokens is smaller than one page "
                             f"({cfg.page_size} tokens)")
        return tokens

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits `[len(batch.logits_indices), vocab_size]` for one step."""
        with forward_context(batch):
            hidden = self._run_model(batch)
            return self.model.compute_logits(hidden[batch.logits_indices]).float()

    def _run_model(self, batch: ForwardBatch) -> torch.Tensor:
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            return self.decode_graphs.run(batch)
        self.attn_backend.plan(batch)
        return self.model(batch.input_ids, batch.positions)

    def __repr__(self) -> str:
        return (f"ModelRunner({self.architecture}, device={self.device}, dtype={self.dtype}, "
                f"context={self.context_length}, kv_tokens={self.kv_pool.capacity}, "
                f"attention={self.attention_backend_name})")
