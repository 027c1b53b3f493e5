"""A minimal stand-in for the scheduler: owns rows and slots, builds EXTEND / DECODE batches."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixpool.worker.forward_batch import ForwardBatch, ForwardMode
from radixpool.worker.model_runner import ModelRunner


@dataclass
class Seq:
    row: int
    ids: list[int] = field(default_factory=list)  # tokens whose K/V are in the pool


class Driver:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.table = runner.req_to_token_pool.table

    def new_seq(self) -> Seq:
        row = self.runner.req_to_token_pool.alloc()
        assert row is not None
        return Seq(row)

    def share_prefix(self, source: Seq, length: int) -> Seq:
        """A new request whose first `length` tokens reuse `source`'s KV (a radix-cache hit)."""
        seq = self.new_seq()
        self.table[seq.row, :length] = self.table[source.row, :length]
        seq.ids = source.ids[:length]
        return seq

    def _last_slots(self, seqs: list[Seq]) -> list[int]:
        return [int(self.table[s.row, len(s.ids) - 1]) if s.ids else 0 for s in seqs]

    def extend(self, seqs: list[Seq], new: list[list[int]],
               all_positions: bool = False) -> torch.Tensor:
        """One EXTEND step; logits of every new token (all_positions) or of each last one."""
        prefix = [len(s.ids) for s in seqs]
        pool = self.runner.kv_pool
        slots = pool.alloc_extend(prefix, [len(t) for t in new], self._last_slots(seqs))
        assert slots is not None, "test KV pool too small"
        self._record(seqs, new, slots)
        batch = ForwardBatch.build(ForwardMode.EXTEND, new, prefix, slots,
                                   [s.row for s in seqs], [True] * len(seqs), self.table, pool)
        if all_positions:
            batch.logits_indices = torch.arange(batch.num_tokens, device=self.table.device)
        return self.runner.forward(batch)

    def prompt_logits(self, prompt: list[int]) -> torch.Tensor:
        """Logits of every position of `prompt`, prefilled as a new request."""
        return self.extend([self.new_seq()], [prompt], all_positions=True)

    def decode(self, seqs: list[Seq], tokens: list[int]) -> torch.Tensor:
        prefix = [len(s.ids) for s in seqs]
        pool = self.runner.kv_pool
        slots = pool.alloc_decode(prefix,
                                  torch.tensor(self._last_slots(seqs), device=self.table.device))
        assert slots is not None, "test KV pool too small"
        self._record(seqs, [[t] for t in tokens], slots)
        batch = ForwardBatch.build(ForwardMode.DECODE, [[t] for t in tokens], prefix, slots,
                                   [s.row for s in seqs], [True] * len(seqs), self.table, pool)
        return self.runner.forward(batch)

    def _record(self, seqs: list[Seq], new: list[list[int]], slots: torch.Tensor) -> None:
        offset = 0
        for seq, ids in zip(seqs, new):
            start = len(seq.ids)
            self.table[seq.row, start:start + len(ids)] = slots[offset:offset + len(ids)]
            seq.ids = seq.ids + list(ids)
            offset += len(ids)

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Prefill all prompts in one step, then decode them together; stop each at EOS."""
        seqs = [self.new_seq() for _ in prompts]
        next_tokens = self.extend(seqs, prompts).argmax(-1).tolist()
        outputs = [[t] for t in next_tokens]
        for _ in range(max_new_tokens - 1):
            next_tokens = self.decode(seqs, next_tokens).argmax(-1).tolist()
            for out, token in zip(outputs, next_tokens):
                out.append(token)
        eos = set(self.runner.eos_token_ids)
        return [_cut_at_eos(out, eos) for out in outputs]


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens
