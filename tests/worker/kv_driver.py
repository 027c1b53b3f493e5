"""A fake model for driving the real scheduler: it checks the KV it reads, not just the tokens.

`FakeModel.run(batch)` writes each new token's (token, position) into a shadow of the KV pool at
the slots the scheduler gave it, then reads every sampled request's whole sequence back through
its request→token row and "samples" a token that is a hash of what it read. A slot that was
freed, handed to someone else or overwritten while a request still reads it changes the tokens,
so comparing the outputs with `expected_output` (the same hash over the true sequence) catches
KV corruption that bookkeeping checks alone could miss.
"""

from __future__ import annotations

import math

from radixpool.worker.mem.kv_pool import KVPool

VOCAB_LO, VOCAB_HI = 5, 40   # a small range, so stop tokens are hit now and then


def next_token(seq: list[int]) -> int:
    h = len(seq)
    for t in seq[-6:]:
        h = (h * 1_000_003 + t) & 0xFFFFFFFF
    return VOCAB_LO + h % (VOCAB_HI - VOCAB_LO)


def expected_output(prompt: list[int], max_new: int, stop_ids: tuple[int, ...] = (),
                    min_new: int = 0) -> tuple[list[int], str]:
    seq, out = list(prompt), []
    while len(out) < max_new:
        token = next_token(seq)
        seq.append(token)
        out.append(token)
        if token in stop_ids and len(out) >= min_new:
            return out, "stop"
    return out, "length"


class FakeModel:
    def __init__(self, pool: KVPool, table) -> None:
        slots = (pool.num_pages + 1) * pool.page_size
        self.token = [-1] * slots
        self.pos = [-1] * slots
        self.table = table
        self.last: dict[int, int] = {}   # row -> its last sampled token (the device's copy)

    def run(self, batch) -> list[int]:
        """One sampled token per request of `batch` with `sample` set, in batch order."""
        loc = batch.out_cache_loc.tolist()
        assert len(loc) == sum(batch.extend_lens)
        cursor, out = 0, []
        for req, new, prefix, wants in zip(batch.reqs, batch.token_ids, batch.prefix_lens,
                                           batch.sample):
            if new is None:   # decoding: the input is the row's last sampled token
                new = [self.last[req.row]]
            for i, token in enumerate(new):
                slot = loc[cursor + i]
                self.token[slot], self.pos[slot] = token, prefix + i
            cursor += len(new)
            if wants:
                row = self.table[req.row, :prefix + len(new)].tolist()
                seq = [self.token[s] if self.pos[s] == i else -1 for i, s in enumerate(row)]
                out.append(next_token(seq))
                self.last[req.row] = out[-1]
        return out


def pages(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)


def make_scheduler(page_size: int, capacity_tokens: int, *, chunk: int = 2048,
                   max_prefill: int = 8192, max_running: int = 64, context: int = 4096,
                   **config: object):
    """The real scheduler over a one-layer pool, with a `FakeModel` reading that pool;
    `config` sets other `EngineConfig` fields (eviction and schedule policies, ...)."""
    import torch

    from radixpool.worker.config import EngineConfig
    from radixpool.worker.mem.kv_pool import ReqToTokenPool
    from radixpool.worker.mem.radix_cache import RadixCache
    from radixpool.worker.scheduler.scheduler import Scheduler

    pool = KVPool(capacity_tokens, page_size, 1, 1, 1, torch.float32, "cpu")
    rows = ReqToTokenPool(max_running + 4, context, "cpu")
    cfg = EngineConfig("unused", page_size=page_size, max_running_requests=max_running,
                       chunked_prefill_size=chunk, max_prefill_tokens=max(chunk, max_prefill),
                       debug_invariants=True, **config)
    cache = RadixCache(pool, page_size, max(16, page_size), cfg.eviction_policy)
    sched = Scheduler(cfg, pool, rows, cache, context, (2,))
    return sched, FakeModel(pool, rows.table)


class Outcome:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None

    def __repr__(self) -> str:
        return f"Outcome({self.tokens}, {self.finish_reason!r}, {self.error!r})"


def collect(outcomes: dict[str, Outcome], deltas) -> None:
    for d in deltas:
        o = outcomes.setdefault(d.rid, Outcome())
        assert o.finish_reason is None, f"{d.rid} got output after it finished"
        o.tokens += d.token_ids
        if d.finished:
            o.finish_reason, o.error = d.finish_reason, d.error


class Loop:
    """The engine core's step loop (`EngineCore.step`) over the fake model: synchronous, or
    overlapped (step N+1 scheduled and run before step N's results are processed)."""

    def __init__(self, sched, model: FakeModel, overlap: bool = False) -> None:
        self.sched, self.model, self.overlap = sched, model, overlap
        self.inflight = None

    @property
    def has_work(self) -> bool:
        return self.sched.has_work or self.inflight is not None

    def step(self, outcomes: dict[str, Outcome]) -> None:
        sched = self.sched
        previous, self.inflight = self.inflight, None
        if previous is not None and not sched.can_schedule_ahead():
            collect(outcomes, sched.process(*previous))
            previous = None
        batch = sched.next_batch()
        if batch is not None:
            launched = (batch, self.model.run(batch))
            if self.overlap:
                self.inflight = launched
            else:
                collect(outcomes, sched.process(*launched))
        elif previous is None:
            collect(outcomes, sched.take_deltas())  # only what finished while scheduling
            assert not sched.has_work, "the scheduler has work but scheduled nothing (livelock)"
        if previous is not None:
            collect(outcomes, sched.process(*previous))
        collect(outcomes, sched.take_deltas())


def step(sched, model, outcomes: dict[str, Outcome]) -> None:
    """One synchronous step; the scheduler must make progress if it has work."""
    Loop(sched, model).step(outcomes)


def run_all(sched, model, outcomes: dict[str, Outcome], max_steps: int = 5000) -> None:
    for _ in range(max_steps):
        if not sched.has_work:
            return
        step(sched, model, outcomes)
        sched.check_invariants()
    raise AssertionError(f"not done after {max_steps} steps")
