"""Decode steps replayed from CUDA graphs captured at start-up, one per batch-size bucket.

A decode step of `n` requests runs in the graph of the smallest captured size `≥ n`; the extra
lanes are padding: token 0 at position 0, a KV length of 1, K/V written to the pool's padding
slot (page 0, which the pool never hands out). Their one KV read is `req_to_token[row, 0]` of a
fixed row: whatever valid slot it holds, only read, and the lane's output is dropped. Padded lanes
therefore write no request's KV, and attention is per lane, so the real lanes compute exactly
what the unpadded step computes.
Batches larger than the largest captured size run eagerly.

The graphs read fixed input buffers (`StaticDecodeInputs`): a step copies its inputs into them,
lets the attention backend plan into its own fixed buffers for that size, and replays. What
"capture" does is a parameter: `capture_cuda_graph` on a GPU; `capture_eager` (run the same
step function on the same buffers, no graph) lets CPU tests check the bucketing and padding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from radixpool.worker.attention.base import AttentionBackend
from radixpool.worker.forward_batch import ForwardBatch, ForwardMode, forward_context

log = logging.getLogger(__name__)

# A capture turns "run the model on the static inputs of this size" into a replay callable.
Capture = Callable[[int, Callable[[], None]], Callable[[], None]]

DEFAULT_MAX_GRAPH_BATCH = 256


def graph_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Captured sizes: 1, 2, 4, 8, then every multiple of 16, up to and including `max_batch`.

    Padding wastes at most 15 lanes above 16 (and under half below), and the number of graphs
    (their capture time and memory) grows only linearly with `max_batch / 16`."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += range(16, max_batch, 16)
    return (*sizes, max_batch)


def bucket_for(batch_size: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `batch_size` lanes, None when none does."""
    return next((s for s in sizes if s >= batch_size), None)


@dataclass(frozen=True)
class Padding:
    row: int    # request→token row padded lanes read their one (ignored) KV entry from
    slot: int   # KV slot padded lanes write (the pool's padding page)


class StaticDecodeInputs:
    """The fixed tensors a captured decode step reads; views of their first `size` rows."""

    def __init__(self, max_batch: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        def ints() -> torch.Tensor:
            return torch.zeros(max_batch, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.out_cache_loc = ints(), ints(), ints()
        self.req_rows, self.seq_lens = ints(), ints()
        self.hidden = torch.zeros(max_batch, hidden_size, dtype=dtype, device=device)

    def fill(self, batch: ForwardBatch, size: int, padding: Padding) -> None:
        n = len(batch.prefix_lens)
        for buf, real, pad in ((self.input_ids, batch.input_ids, 0),
                               (self.positions, batch.positions, 0),
                               (self.out_cache_loc, batch.out_cache_loc, padding.slot),
                               (self.req_rows, batch.req_rows, padding.row),
                               (self.seq_lens, batch.seq_lens, 1)):
            buf[:n].copy_(real)
            buf[n:size].fill_(pad)

    def batch(self, template: ForwardBatch, size: int) -> ForwardBatch:
        """`template` (n real lanes) as a batch of `size` lanes over the static buffers."""
        pad = size - len(template.prefix_lens)
        return replace(template, input_ids=self.input_ids[:size],
                       positions=self.positions[:size], out_cache_loc=self.out_cache_loc[:size],
                       req_rows=self.req_rows[:size], seq_lens=self.seq_lens[:size],
                       prefix_lens=template.prefix_lens + [0] * pad,
                       extend_lens=template.extend_lens + [1] * pad,
                       attn_metadata=None, graph_size=size)


def capture_eager(size: int, step: Callable[[], None]) -> Callable[[], None]:
    return step


class CudaGraphCapture:
    """Captures each size into a CUDA graph; all graphs share one memory pool, captured from the
    largest size down so the smaller ones reuse its activations' memory."""

    def __init__(self) -> None:
        self.pool = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def __call__(self, size: int, step: Callable[[], None]) -> Callable[[], None]:
        step()   # warm-up outside capture: lazy initialisation, kernel selection
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[size] = graph
        return graph.replay


class DecodeGraphs:
    """Runs DECODE batches of up to `max(sizes)` requests through captured steps."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, sizes: tuple[int, ...],
                 padding: Padding, inputs: StaticDecodeInputs, template: ForwardBatch,
                 capture: Capture) -> None:
        self.model, self.backend, self.sizes = model, backend, sizes
        self.padding, self.inputs = padding, inputs
        self._replays: dict[int, Callable[[], None]] = {}
        start = time.perf_counter()
        for size in sorted(sizes, reverse=True):
            with forward_context(self._prepare(template, size)):
                self._replays[size] = capture(size, self._step_fn(size))
        self.capture_seconds = time.perf_counter() - start

    def _prepare(self, batch: ForwardBatch, size: int) -> ForwardBatch:
        self.inputs.fill(batch, size, self.padding)
        padded = self.inputs.batch(batch, size)
        self.backend.plan(padded)
        return padded

    def _step_fn(self, size: int) -> Callable[[], None]:
        """The model over the static inputs of `size` lanes, under whatever batch is current (a
        captured graph keeps the kernels it launched; an eager replay re-reads the batch)."""
        inputs = self.inputs

        def step() -> None:
            inputs.hidden[:size].copy_(self.model(inputs.input_ids[:size],
                                                  inputs.positions[:size]))
        return step

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.mode is ForwardMode.DECODE
                and bucket_for(len(batch.prefix_lens), self.sizes) is not None)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states `[n, hidden]` of the batch's n lanes (a view into the static output)."""
        n = len(batch.prefix_lens)
        size = bucket_for(n, self.sizes)
        padded = self._prepare(batch, size)
        with forward_context(padded):
            self._replays[size]()
        return self.inputs.hidden[:n]
