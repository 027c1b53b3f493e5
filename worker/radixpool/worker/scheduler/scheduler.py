"""Continuous batching over the radix cache: what runs next, and what its results change.

One step = one forward pass over a batch of requests, each computing the tokens it lacks KV for
(`Req.uncomputed`): the rest of a prompt (or one chunk of it), or one token when decoding.
`next_batch`:
1. makes room for every running request's next decode token, retracting the youngest running
   requests back to the queue if even eviction cannot (their KV goes into the tree first, so a
   resumed request re-matches whatever survived; admission then reserves more for decode);
2. admits waiting requests in the queue's order (longest cached prefix first) under the step's
   token budget, the running-request cap and the KV budget, chunking a long prompt; requests
   whose uncached prefix is already being computed by a request admitted this step are held
   back, so they hit the cache that request fills (in-batch prefix de-duplication);
3. returns decode tokens and prefill tokens as one batch (EXTEND), or a pure DECODE batch.
`process` appends sampled tokens, decides who finished, and hands KV to the cache: every request
inserts its computed prefix after prefill (and after each chunk), finished ones insert everything
and give back their row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from radixpool.worker.config import EngineConfig
from radixpool.worker.forward_batch import ForwardMode
from radixpool.worker.mem.kv_pool import KVPool, ReqToTokenPool
from radixpool.worker.mem.radix_cache import RadixCache
from radixpool.worker.messages import TokenDelta
from radixpool.worker.request import Req, Status
from radixpool.worker.scheduler.waiting_queue import Verdict, WaitingQueue

# In-batch de-duplication holds a request back when it shares at least this many uncached
# blocks with one admitted in the same step.
DEDUP_MIN_BLOCKS = 2
# Decode reservation: admission keeps room for `ratio * remaining new tokens` of every running
# request (capped per request). The ratio decays while decoding goes well and jumps on retraction.
RESERVE_CAP = 256
RATIO_INIT, RATIO_MIN, RATIO_DECAY, RATIO_BUMP = 0.5, 0.1, 0.001, 0.3


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]
    token_ids: list[list[int]]   # new tokens per request
    prefix_lens: list[int]       # KV length before this step
    out_cache_loc: torch.Tensor  # slots for every new token, requests concatenated
    sample: list[bool]           # whether the request gets a sampled token from this step


class Scheduler:
    def __init__(self, config: EngineConfig, pool: KVPool, rows: ReqToTokenPool,
                 cache: RadixCache, context_length: int, eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.pool = pool
        self.rows = rows
        self.cache = cache
        self.context_length = context_length
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting = WaitingQueue(cache, config.schedule_policy)
        self.running: dict[str, Req] = {}
        self.retracted_total = 0
        self.new_token_ratio = RATIO_INIT
        self._seq = 0
        self._pending_deltas: list[TokenDelta] = []  # finishes decided outside `process`
        self.admission_paused = False  # set while a cache flush waits for running requests

    # ------------------------------------------------------------------ intake
    def add(self, req: Req) -> TokenDelta | None:
        """Queue a request; returns an error delta if it can never run here."""
        limit = min(self.context_length, self.pool.capacity)
        if not req.input_ids:
            return self._refuse(req, "the prompt is empty")
        if len(req.input_ids) >= limit:
            return self._refuse(req, f"the prompt has {len(req.input_ids)} tokens; this worker "
                                     f"takes at most {limit - 1}")
        self._seq += 1
        req.seq = self._seq
        self.waiting.push(req)
        return None

    @staticmethod
    def _refuse(req: Req, message: str) -> TokenDelta:
        req.status = Status.FINISHED
        return TokenDelta(req.rid, [], finished=True, finish_reason="abort",
                          prompt_tokens=len(req.input_ids), error=message)

    def abort(self, rid: str) -> TokenDelta | None:
        req = self.waiting.get(rid)
        if req is not None:
            self.waiting.remove(req)
        else:
            req = self.running.pop(rid, None)
            if req is None:
                return None
            self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = "abort"
        return self._delta(req, [])

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ------------------------------------------------------------------ scheduling
    def next_batch(self, now: float | None = None) -> ScheduledBatch | None:
        now = time.time() if now is None else now
        decode, chunking, reserved = self._make_room_for_decode()
        prefill, takes = self._admit(now, self.config.max_prefill_tokens - len(decode), chunking,
                                     kv_budget=self.pool.available_size()
                                     + self.cache.evictable_size - len(decode) - reserved)
        if not decode and not prefill:
            return None
        reqs = prefill + decode
        token_ids = [r.fill_ids[r.kv_len:r.kv_len + t] for r, t in zip(prefill, takes)]
        token_ids += [[(r.output_ids or r.input_ids)[-1]] for r in decode]
        prefix_lens = [r.kv_len for r in reqs]
        slots = self._alloc_slots(prefill, takes, decode)
        sample = [r.kv_len + t == r.seq_len for r, t in zip(prefill, takes)] + [True] * len(decode)
        mode = ForwardMode.EXTEND if prefill else ForwardMode.DECODE
        return ScheduledBatch(mode, reqs, token_ids, prefix_lens, slots, sample)

    def _make_room_for_decode(self) -> tuple[list[Req], list[Req], int]:
        """Decode-ready requests (a slot each ensured), prompts mid-prefill, and the KV to
        reserve for the running requests' growth."""
        decode, chunking, growth = [], [], 0
        for r in self.running.values():
            if r.seq_len - r.kv_len == 1:
                decode.append(r)
            else:
                chunking.append(r)
            growth += min(r.params.max_new_tokens - len(r.output_ids), RESERVE_CAP)
        while decode and not self._ensure_free(len(decode)):
            victim = max(decode, key=lambda r: r.seq)  # youngest first
            decode.remove(victim)
            if len(self.running) == 1:
                # Alone and still out of memory: its sequence outgrew this worker's KV.
                self.running.pop(victim.rid)
                self._release(victim)
                victim.status, victim.finish_reason = Status.FINISHED, "length"
                self._pending_deltas.append(self._delta(victim, []))
            else:
                self._retract(victim)
        return decode, chunking, int(growth * self.new_token_ratio)

    def _ensure_free(self, num_tokens: int) -> bool:
        short = num_tokens - self.pool.available_size()
        if short > 0:
            self.cache.evict(short)
        return self.pool.available_size() >= num_tokens

    def _admit(self, now: float, budget: int, chunking: list[Req],
               kv_budget: int) -> tuple[list[Req], list[int]]:
        admitted: list[Req] = []
        takes: list[int] = []
        chunk = self.config.chunked_prefill_size
        pending_blocks: set[int] = set()
        state = {"budget": budget, "chunked": False, "kv": kv_budget}

        def try_take(req: Req, take: int, resumed: bool) -> bool:
            if take <= 0 or take > state["kv"]:
                return False
            state["kv"] -= take + min(req.remaining_new_tokens(), RESERVE_CAP) * \
                self.new_token_ratio * (not resumed)
            state["budget"] -= take
            admitted.append(req)
            takes.append(take)
            return True

        # A prompt being prefilled chunk by chunk continues first.
        for req in chunking:
            if state["budget"] > 0:
                take = min(req.uncomputed, chunk, state["budget"])
                state["chunked"] = take < req.uncomputed
                try_take(req, take, resumed=True)

        def decide(req: Req) -> Verdict:
            if len(self.running) + len(admitted) >= self.config.max_running_requests or \
                    state["budget"] <= 0:
                return Verdict.STOP
            if self.waiting.lpm and pending_blocks:
                ahead = self.waiting.uncached_blocks(req, req.match_blocks, DEDUP_MIN_BLOCKS)
                if len(ahead) == DEDUP_MIN_BLOCKS and \
                        all(int(h) in pending_blocks for h in ahead):
                    return Verdict.SKIP
            match = self.cache.match_prefix(req.fill_ids[:req.seq_len - 1], req.namespace)
            evictable = self.cache.evictable_size
            self.cache.lock(match.node)
            locked = evictable - self.cache.evictable_size  # matched KV no longer evictable
            need = req.seq_len - match.length
            take = min(need, chunk, state["budget"])
            if take < need and state["chunked"]:
                self.cache.unlock(match.node)
                return Verdict.STOP  # one chunked prompt at a time
            state["kv"] -= locked
            row = self.rows.alloc()
            if row is None or not try_take(req, take, resumed=False):
                if row is not None:
                    self.rows.free(row)
                self.cache.unlock(match.node)
                state["kv"] += locked
                return Verdict.STOP
            state["chunked"] = take < need
            req.row, req.last_node = row, match.node
            req.prefix_len = req.kv_len = match.length
            if match.length:
                self.rows.table[row, :match.length] = match.slots
            if req.cached_tokens < 0:
                req.cached_tokens = min(match.length, len(req.input_ids))
                req.queue_time = max(0.0, now - req.arrival_time)
            if req.block_hashes is not None:
                pending_blocks.update(req.block_hashes[req.match_blocks:].tolist())
            return Verdict.ADMIT

        if not self.admission_paused:
            self.waiting.offer(now, self.config.max_queue_wait_s, decide)
        for req in admitted:
            if req.status is not Status.RUNNING:
                req.status = Status.RUNNING
                self.running[req.rid] = req
        return admitted, takes

    def _alloc_slots(self, prefill: list[Req], takes: list[int],
                     decode: list[Req]) -> torch.Tensor:
        table = self.rows.table
        parts = []
        if decode:
            rows = torch.tensor([r.row for r in decode], device=table.device)
            lens = torch.tensor([r.kv_len for r in decode], device=table.device)
            # the previous slot matters only with pages (the new token may share its page)
            last = table[rows, lens - 1] if self.pool.page_size > 1 else lens
            slots = self.pool.alloc_decode(lens, last)
            assert slots is not None, "decode room was ensured"
            table[rows, lens] = slots
            parts.append(slots)
        if prefill:
            # Worst case with pages: each request may start a page it fills only partly.
            self._ensure_free(sum(takes) + (self.pool.page_size - 1) * len(prefill))
            last = [int(table[r.row, r.kv_len - 1]) if r.kv_len % self.pool.page_size else 0
                    for r in prefill]
            slots = self.pool.alloc_extend([r.kv_len for r in prefill], takes, last)
            assert slots is not None, "admission reserved KV that is not there"
            cursor = 0
            for req, take in zip(prefill, takes):
                table[req.row, req.kv_len:req.kv_len + take] = slots[cursor:cursor + take]
                cursor += take
            parts.append(slots)
        if len(parts) > 1:  # the batch lists prefill requests first
            parts.reverse()
            return torch.cat(parts)
        return parts[0]

    # ------------------------------------------------------------------ results
    def process(self, batch: ScheduledBatch, sampled: list[int],
                logprobs: list | None = None, top_logprobs: list | None = None) -> list[TokenDelta]:
        """Apply one step's results. `sampled[j]` belongs to the j-th request with sample=True."""
        deltas, pending = [], self._pending_deltas
        self._pending_deltas = []
        deltas.extend(pending)
        j = 0
        decoding = batch.mode is ForwardMode.DECODE
        for req, new, wants in zip(batch.reqs, batch.token_ids, batch.sample):
            req.kv_len += len(new)
            if req.rid not in self.running:
                continue  # aborted while in flight
            if not wants:
                self._cache_prefix(req)  # a finished chunk becomes shareable now
                continue
            token = sampled[j]
            lp = None if logprobs is None else logprobs[j]
            top = None if top_logprobs is None else top_logprobs[j]
            j += 1
            req.append(token)
            if self._check_finished(req, token):
                self.running.pop(req.rid)
                self._release(req)
            elif len(new) > 1 or len(req.output_ids) == 1:
                self._cache_prefix(req)
            deltas.append(self._delta(req, [token], lp, top))
        if decoding:
            self.new_token_ratio = max(RATIO_MIN, self.new_token_ratio - RATIO_DECAY)
        return deltas

    def _check_finished(self, req: Req, token: int) -> bool:
        p = req.params
        n = len(req.output_ids)
        stops = (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        if stops and n >= p.min_new_tokens:
            req.finish_reason, req.matched_stop_token = "stop", token
        if req.finish_reason is None and (n >= p.max_new_tokens
                                          or req.seq_len >= self.context_length):
            req.finish_reason = "length"
        if req.finish_reason is None:
            return False
        req.status = Status.FINISHED
        return True

    @staticmethod
    def _delta(req: Req, tokens: list[int], lp=None, top=None) -> TokenDelta:
        finished = req.status is Status.FINISHED
        return TokenDelta(
            req.rid, tokens, None if lp is None else [lp], None if top is None else [top],
            finished, req.finish_reason, req.matched_stop_token,
            len(req.input_ids), max(0, req.cached_tokens), req.queue_time,
            core_seconds=time.perf_counter() - req.core_start if finished else None)

    # ------------------------------------------------------------------ KV hand-over
    def _cache_prefix(self, req: Req) -> None:
        """Insert the computed prefix into the tree and re-lock the deeper node.

        Slots the tree already had ([prefix_len, present)) are freed and the row re-pointed at
        the tree's copies; slots past the page-aligned end stay the request's.
        """
        slots = self.rows.table[req.row, :req.kv_len]
        present, node, tree_values = self.cache.insert_path(
            req.fill_ids[:req.kv_len], slots, req.namespace)
        if present > req.prefix_len:  # computed twice: free ours, point the row at the tree's
            self.pool.free(slots[req.prefix_len:present].clone())
            slots[req.prefix_len:present] = torch.cat(tree_values)[req.prefix_len:present]
        self.cache.lock(node)
        self.cache.unlock(req.last_node)
        req.last_node = node
        req.prefix_len = req.kv_len - req.kv_len % self.pool.page_size

    def _release(self, req: Req) -> None:
        """Give back the row and the lock; the computed KV goes into the tree (so a retracted or
        finished request's prefix stays reusable), every other slot it owns is freed."""
        slots = self.rows.table[req.row, :req.kv_len].clone()
        owned_from = req.prefix_len
        if req.kv_len > req.prefix_len:
            # The tree takes [present, aligned end); duplicates before it and the partial page
            # after it stay ours to free.
            present = self.cache.insert(req.fill_ids[:req.kv_len], slots, req.namespace)
            if present > req.prefix_len:
                self.pool.free(slots[req.prefix_len:present])
            owned_from = req.kv_len - req.kv_len % self.pool.page_size
        self.pool.free(slots[owned_from:])
        self.cache.unlock(req.last_node)
        self.rows.free(req.row)
        req.row, req.last_node, req.kv_len, req.prefix_len = None, None, 0, 0

    def _retract(self, req: Req) -> None:
        self.running.pop(req.rid)
        self._release(req)
        req.retractions += 1
        self.retracted_total += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + RATIO_BUMP)
        self.waiting.push(req)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Every slot free, cached or owned by exactly one running request; locks balanced."""
        self.cache.check()
        ps = self.pool.page_size
        owned: list[int] = []
        for node in self.cache.nodes():
            owned.extend(node.value.tolist())
        expected_locks: dict[int, int] = {}
        for req in self.running.values():
            own = self.rows.table[req.row, req.prefix_len:req.kv_len].tolist()
            pages = {s // ps for s in own}
            owned.extend(p * ps + i for p in pages for i in range(ps))
            node = req.last_node
            while node.parent is not None:
                expected_locks[id(node)] = expected_locks.get(id(node), 0) + 1
                node = node.parent
        assert len(owned) == len(set(owned)), "a KV slot is owned twice"
        free = self.pool.free_slots_set()
        assert not free & set(owned), "a KV slot is both free and owned"
        assert len(free) + len(owned) == self.pool.capacity, \
            f"KV slots leaked: {self.pool.capacity - len(free) - len(owned)}"
        for node in self.cache.nodes():
            assert node.lock_ref == expected_locks.get(id(node), 0), "lock count unbalanced"
        assert self.rows.num_free() + len(self.running) == self.rows.table.shape[0], \
            "request rows leaked"
        for req in self.running.values():
            assert req.status is Status.RUNNING
