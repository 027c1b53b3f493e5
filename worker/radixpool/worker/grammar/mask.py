"""One step's vocabulary masks for the constrained rows of a batch.

xgrammar fills one bitmask row (32 tokens per int32) per constrained request on the host, all of
them in one batched call. The rows go to the device in one copy, lose the special tokens no
grammar may emit (a stop token stays: the grammar allows it when the output is complete), and are
unpacked to a boolean [rows, vocab] mask by one shift-and-mask op. Unconstrained rows of the
batch are not touched: the sampler applies the mask to the constrained rows only. A request
verifying a draft (exact jump-forward) has one row per draft position, filled one after the other
as its matcher walks the draft.
"""

from __future__ import annotations

from typing import Any

import torch

from radixpool.worker.grammar.compiler import ModelVocab
from radixpool.worker.grammar.matcher import RequestGrammar


class GrammarMasks:
    def __init__(self, vocab: ModelVocab, vocab_size: int, device: torch.device) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.device = device
        self.words = (vocab_size + 31) // 32
        self._batch: Any = xgr.BatchGrammarMatcher()
        self._host = self._alloc(64)
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        allowed = torch.ones(self.words * 32, dtype=torch.bool)
        allowed[list(vocab.banned)] = False
        weights = torch.ones(32, dtype=torch.int64) << torch.arange(32)
        packed = (allowed.view(self.words, 32).long() * weights).sum(-1)
        packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)  # as int32 bits
        self._allowed = packed.to(torch.int32).to(device)

    def _alloc(self, rows: int) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.empty((rows, self.words), dtype=torch.int32, pin_memory=pin)

    def build(self, grammars: list[RequestGrammar],
              drafts: list[list[int]] | None = None) -> torch.Tensor:
        """bool [rows, vocab_size] on the device: True where the grammar allows. One row per
        grammar; with `drafts`, a grammar with draft d1..dk has k + 1 rows, in order: its mask
        now, then after each of d1..dk (which it must accept; it is rolled back after)."""
        m = len(grammars) + sum(len(d) for d in drafts or ())
        if self._host.shape[0] < m:
            self._host = self._alloc(max(m, 2 * self._host.shape[0]))
        host = self._host[:m]
        try:
            if not drafts or not any(drafts):
                self._batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], host)
            else:
                row = 0
                for grammar, draft in zip(grammars, drafts):
                    row = _fill(grammar, draft, host, row)
        except Exception:   # the library failed on some request: find it, mask the others
            self._fill_each(grammars, drafts or [[]] * len(grammars), host)
        words = host.to(self.device, non_blocking=True) & self._allowed
        bits = (words.unsqueeze(-1) >> self._shifts) & 1
        return bits.view(m, self.words * 32)[:, :self.vocab_size].bool()

    @staticmethod
    def _fill_each(grammars: list[RequestGrammar], drafts: list[list[int]],
                   host: torch.Tensor) -> None:
        """Each grammar on its own; one that fails gets `failure` set and unmasked rows (its
        token is discarded: the request ends with the failure when its step is processed)."""
        row = 0
        for grammar, draft in zip(grammars, drafts):
            try:
                _fill(grammar, draft, host, row)
            except Exception as exc:
                grammar.failure = grammar.failure or exc
                host[row:row + len(draft) + 1] = -1
            row += len(draft) + 1


def _fill(grammar: RequestGrammar, draft: list[int], host: torch.Tensor, row: int) -> int:
    """Rows `row`.. of `host`: the grammar's mask now, then after each draft token (accepted
    in turn, rolled back after). Returns the next free row."""
    if grammar.failure is not None:
        raise grammar.failure
    matcher = grammar.matcher
    for token in draft:
        matcher.fill_next_token_bitmask(host, row)
        row += 1
        if not matcher.accept_token(token):
            raise RuntimeError(f"a draft token ({token}) the grammar refuses")
    matcher.fill_next_token_bitmask(host, row)
    if draft:
        matcher.rollback(len(draft))
    return row + 1
