"""A request's life inside the engine core: waiting → running (prefill chunks, decode) → finished.

KV ownership while a request holds a row of the request→slot table:
- `table[row, :prefix_len]` are the tree's slots of the locked node `last_node` (shared, read-only);
- `table[row, prefix_len:kv_len]` are slots this request owns and must insert or free;
- `fill_ids[kv_len:]` have no KV yet: the next step computes them (one token when decoding,
  the rest of the prompt in prefill, everything not re-matched after a retraction) and samples.
`kv_len` advances when a step is *scheduled*; the step's sampled token is appended when its
results are processed. In between the token is `pending` (on the device, in the request→token
table's `last_token` entry for its row): with one step in flight, the next step decodes from it
without the host ever seeing it. `run_epoch` changes whenever the request leaves the running set,
so results of a step scheduled before that (a retraction, an abort) are recognised and dropped.
A waiting request holds no row, no lock and no slots (retraction gives all three back).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from radixpool.worker.mem.radix_cache import TreeNode
from radixpool.worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixpool.worker.grammar.matcher import RequestGrammar


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    namespace: str | None = None
    arrival_time: float = 0.0
    core_start: float = field(default_factory=time.perf_counter)   # arrival in the core
    seq: int = 0                          # admission-order tie break (FCFS)

    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    matched_stop_token: int | None = None

    row: int | None = None
    kv_len: int = 0
    prefix_len: int = 0
    last_node: TreeNode | None = None

    pending: int = 0                      # sampled tokens scheduled but not yet appended
    decoding: bool = False                # its last token was sampled while it held its row
    run_epoch: int = 0
    cached_tokens: int = -1               # prompt tokens reused at first admission (-1: not yet)
    queue_time: float | None = None
    retractions: int = 0
    # Its logits went non-finite: its KV may hold NaN (which a masked attention column still
    # spreads, 0 x NaN), so none of that goes into the tree and what got there is discarded.
    kv_suspect: bool = False

    # The prompt's block hashes, as its `queued` event named them (the waiting queue reuses them).
    prompt_hashes: np.ndarray | None = None
    # Incremental longest-prefix-match bookkeeping (owned by the waiting queue).
    block_hashes: np.ndarray | None = None
    match_blocks: int = 0
    version: int = 0                      # bumps on every priority change (stale heap entries)
    queue_epoch: int = 0                  # bumps on every enqueue (stale arrival entries)
    queue_group: object | None = None     # the waiting queue's group it is in

    seq_len: int = 0                      # len(input_ids) + len(output_ids), kept by append
    grammar: RequestGrammar | None = None  # structured output: has accepted every output token
    # Exact jump-forward: tokens the grammar forces after the last one, to be verified by the
    # next step (computed after the last token, in the same extend); never part of the output
    # or the tree until verified (grammar/draft.py).
    draft: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seq_len = len(self.input_ids) + len(self.output_ids)

    def append(self, token: int) -> None:
        self.output_ids.append(token)
        self.seq_len += 1

    def replace_last(self, tokens: list[int]) -> None:
        """Put `tokens` in place of the last output token (which has no KV yet)."""
        self.output_ids[-1:] = tokens
        self.seq_len += len(tokens) - 1

    @property
    def fill_ids(self) -> list[int]:
        """Every token of the sequence so far: prompt, then generated."""
        return self.input_ids + self.output_ids

    @property
    def uncomputed(self) -> int:
        """Tokens without KV, counting pending ones: the next step computes `fill_ids[kv_len:]`
        (decode: just one, maybe still on the device)."""
        return self.seq_len + self.pending - self.kv_len

    def remaining_new_tokens(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)
