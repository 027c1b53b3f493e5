"""Sizing the KV pool from a memory fraction, with every per-request tensor reserved first.

`mem_fraction` of the accelerator memory still free once the weights are loaded is the static
budget: the per-request tensors (the request→token table, the penalty counts, the sampler's
per-step buffers at a full batch) are taken out of it *first*, and the KV pool gets the rest, in
whole pages. The remaining `1 - mem_fraction` is the forward pass's activations' headroom. A
full batch therefore never runs out of memory because a per-request tensor grew after the KV
cache took its share (the penalty counts never grow past `penalty_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Float32 [batch, vocab] buffers a sampling step may hold at once: the logits, the log-softmax for
# logprobs, and the Gumbel noise / candidate scores.
SAMPLER_VOCAB_BUFFERS = 3
INT64_BYTES, FLOAT32_BYTES, BOOL_BYTES = 8, 4, 1


@dataclass(frozen=True)
class PerRequestMemory:
    rows: int             # request→token table rows
    context_length: int   # its columns
    vocab_size: int
    penalty_rows: int     # requests whose penalty counts are kept at once
    max_batch: int        # requests sampled in one step

    @property
    def table_bytes(self) -> int:
        return self.rows * self.context_length * INT64_BYTES

    @property
    def penalty_bytes(self) -> int:
        return self.penalty_rows * self.vocab_size * (FLOAT32_BYTES + BOOL_BYTES)

    @property
    def sampler_bytes(self) -> int:
        return self.max_batch * self.vocab_size * FLOAT32_BYTES * SAMPLER_VOCAB_BUFFERS

    @property
    def total_bytes(self) -> int:
        return self.table_bytes + self.penalty_bytes + self.sampler_bytes


def kv_tokens_for_memory(free_bytes: int, mem_fraction: float, kv_bytes_per_token: int,
                         per_request: PerRequestMemory, page_size: int) -> int:
    """KV tokens (whole pages) that fit in `mem_fraction` of `free_bytes` once the per-request
    tensors are reserved."""
    budget = int(free_bytes * mem_fraction) - per_request.total_bytes
    tokens = max(0, budget) // kv_bytes_per_token
    tokens -= tokens % page_size
    if tokens < page_size:
        raise ValueError(
            f"mem_fraction {mem_fraction} of {free_bytes / 2**30:.2f} GiB free leaves no room "
            f"for the KV cache after {per_request.total_bytes / 2**30:.2f} GiB of per-request "
            f"tensors: raise mem_fraction or lower max_running_requests / context_length")
    return tokens
