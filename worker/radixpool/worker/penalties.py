"""Repetition / frequency / presence penalties with token counts that live on the device.

Recounting every penalised request's tokens from Python lists each step costs O(total tokens) at
batch 256; instead each request (identified by `SamplingRow.key`, the request id) owns one row of
two persistent tensors:
  `counts[slot, v]`      how often v was generated so far (float32, for frequency / presence),
  `in_prompt[slot, v]`   whether v occurs in the prompt (for the repetition penalty).
A step only scatters the tokens generated since the previous step (usually one per row), so the
per-row cost is bounded; the prompt is scattered once, when the slot is filled.

The state is a cache, never the truth: `SamplingRow.output_ids` is. A row whose key is unknown, or
whose output is shorter than what its slot has counted (a reused key), is recounted from scratch.
Rows without a key get a slot for the duration of one call. `release(key)` frees a finished
request's slot; when more than `max_requests` keys are held, the least recently used ones not in
the current batch are dropped (they would be recounted if they came back).

Semantics:
  repetition (Hugging Face `RepetitionPenaltyLogitsProcessor`): for v in prompt ∪ generated,
      logit = logit / r if logit > 0 else logit * r
  frequency / presence (OpenAI), over generated tokens only:
      logit -= count(v) * frequency_penalty + (count(v) > 0) * presence_penalty
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from radixpool.worker.device_copy import to_device


@dataclass
class _Slot:
    index: int
    counted: int  # how many of the row's output_ids are in counts[index]; -1: slot not filled


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device, max_requests: int = 1024,
                 preallocate: bool = False) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.max_requests = max_requests
        self._slots: OrderedDict[Hashable, _Slot] = OrderedDict()  # LRU order, newest last
        self._free: list[int] = []
        self._counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self._in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._true = torch.ones((), dtype=torch.bool, device=device)
        if preallocate:  # on GPU: the memory was reserved before the KV pool was sized
            self._grow(max_requests)

    def release(self, key: Hashable) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot.index)

    def apply(self, logits: torch.Tensor, row_index: Sequence[int], keys: Sequence[Hashable],
              prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
              factors: torch.Tensor) -> None:
        """Penalise `logits[row_index[i]]` in place for each listed row.

        `factors` is a float32 [n, 3] tensor on the device: repetition, frequency, presence.
        """
        slots = self._update(keys, prompts, outputs)
        slot_t = to_device(slots, torch.long, self.device)
        rows_t = to_device(row_index, torch.long, self.device)
        x = logits[rows_t]
        counts = self._counts[slot_t]
        generated = counts > 0
        seen = self._in_prompt[slot_t].logical_or_(generated)
        rep, freq, pres = factors[:, 0:1], factors[:, 1:2], factors[:, 2:3]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x -= counts * freq + generated * pres
        logits.index_copy_(0, rows_t, x)
        for key in keys:
            if isinstance(key, _OneCall):
                self.release(key)

    def _update(self, keys: Sequence[Hashable], prompts: Sequence[Sequence[int]],
                outputs: Sequence[Sequence[int]]) -> list[int]:
        """Bring each key's slot up to date with its row; return the slot indices."""
        batch = set(keys)
        slots: list[int] = []
        fresh: list[int] = []
        count_slot: list[int] = []
        count_token: list[int] = []
        prompt_slot: list[int] = []
        prompt_token: list[int] = []
        for key, prompt, output in zip(keys, prompts, outputs, strict=True):
            slot = self._slots.get(key)
            if slot is None:
                slot = _Slot(self._take_slot(batch), -1)
                self._slots[key] = slot
            else:
                self._slots.move_to_end(key)
            if not 0 <= slot.counted <= len(output):
                # Empty or stale (the key was reused): recount from scratch.
                fresh.append(slot.index)
                slot.counted = 0
                prompt_slot.extend([slot.index] * len(prompt))
                prompt_token.extend(prompt)
            new = output[slot.counted:]
            count_slot.extend([slot.index] * len(new))
            count_token.extend(new)
            slot.counted = len(output)
            slots.append(slot.index)
        if fresh:
            fresh_t = to_device(fresh, torch.long, self.device)
            self._counts.index_fill_(0, fresh_t, 0.0)
            self._in_prompt.index_fill_(0, fresh_t, False)
        if prompt_token:
            index = (to_device(prompt_slot, torch.long, self.device),
                     to_device(prompt_token, torch.long, self.device))
            self._in_prompt.index_put_(index, self._true)
        if count_token:
            index = (to_device(count_slot, torch.long, self.device),
                     to_device(count_token, torch.long, self.device))
            ones = torch.ones(len(count_token), dtype=torch.float32, device=self.device)
            self._counts.index_put_(index, ones, accumulate=True)
        return slots

    def _take_slot(self, batch: set[Hashable]) -> int:
        while len(self._slots) >= self.max_requests:
            victim = next((k for k in self._slots if k not in batch), None)
            if victim is None:
                break
            self.release(victim)
        if not self._free:
            self._grow()
        return self._free.pop()

    def _grow(self, new: int | None = None) -> None:
        """More rows: doubling, never past `max_requests` while the LRU can make room."""
        old = self._counts.shape[0]
        if new is None:
            new = max(8, 2 * old)
            if old < self.max_requests:
                new = min(new, self.max_requests)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.float32, device=self.device)
        in_prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self._counts
        in_prompt[:old] = self._in_prompt
        self._counts, self._in_prompt = counts, in_prompt
        self._free.extend(range(new - 1, old - 1, -1))


class _OneCall:
    """Key for a row without a request id: its slot lives for one `apply` call."""

    __slots__ = ()


def one_call_key() -> Hashable:
    return _OneCall()
