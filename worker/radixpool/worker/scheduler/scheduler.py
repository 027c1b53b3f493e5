"""Continuous batching over the radix cache: what runs next, and what its results change.

One step = one forward pass over a batch of requests, each computing the tokens it lacks KV for
(`Req.uncomputed`): the rest of a prompt (or one chunk of it), or one token when decoding. The
parts, each owning one concern: `WaitingQueue` (order), `PrefillAdder` (one step's admission),
`RunningSet` (decode set, growth reservation, retraction victims), `KVManager` (pages, rows,
locks, tree hand-over). KV is charged in pages everywhere. `next_batch`:
1. makes room for every decoding request's next token, retracting the youngest running
   requests back to the queue if even eviction cannot;
2. admits: prompts mid-prefill continue, then waiting requests in the queue's order;
3. if nothing could run although requests are running (prompts mid-prefill with no room),
   retracts the youngest and tries again: an engine with work always makes progress;
4. allocates the step's pages and advances each request's KV length *now*, at schedule time
   (ownership moves when a step is scheduled, not when its results come back).
`process` appends sampled tokens, decides who finished, and hands KV to the cache: every request
inserts its computed prefix after prefill (and after each chunk), finished ones insert everything
and give back their row.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from radixpool.protocol.errors import NONFINITE_LOGITS
from radixpool.worker.config import EngineConfig
from radixpool.worker.forward_batch import ForwardMode
from radixpool.worker.grammar.draft import commit, propose_draft
from radixpool.worker.mem.kv_pool import KVPool, ReqToTokenPool
from radixpool.worker.mem.radix_cache import RadixCache
from radixpool.worker.messages import TokenDelta
from radixpool.worker.request import Req, Status
from radixpool.worker.sampler import NONFINITE
from radixpool.worker.scheduler.kv_manager import KVManager
from radixpool.worker.scheduler.prefill import PrefillAdder
from radixpool.worker.scheduler.running import RunningSet
from radixpool.worker.scheduler.waiting_queue import WaitingQueue

log = logging.getLogger("radixpool.core")


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]              # prefill requests first, then decoding ones
    # New tokens per request; None for a decoding request: its one input token is the one last
    # sampled for its row (`ReqToTokenPool.last_token`), maybe not on the host yet.
    token_ids: list[list[int] | None]
    prefix_lens: list[int]       # KV length before this step
    extend_lens: list[int]       # new tokens per request
    out_cache_loc: torch.Tensor  # slots for every new token, requests concatenated
    sample: list[bool]           # whether the request gets a sampled token from this step
    epochs: list[int]            # each request's run_epoch when scheduled
    # Per request, the draft this step verifies: the last len(draft) of its new tokens. Such a
    # request gets len(draft) + 1 chosen tokens (one per position from its last real token).
    drafts: list[list[int]]

    @property
    def rows(self) -> list[int]:
        return [r.row for r in self.reqs]


class Scheduler:
    def __init__(self, config: EngineConfig, pool: KVPool, rows: ReqToTokenPool,
                 cache: RadixCache, context_length: int, eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.pool = pool
        self.rows = rows
        self.cache = cache
        self.kv = KVManager(pool, rows, cache)
        self.context_length = context_length
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting = WaitingQueue(cache, config.schedule_policy)
        self.run_set = RunningSet(self.kv)
        self.running = self.run_set.reqs
        self.retracted_total = 0
        self.nonfinite_total = 0   # requests ended because the model's logits were not finite
        self.jump_forward_tokens = 0   # tokens appended without a forward pass of their own
        self._seq = 0
        self._pending_deltas: list[TokenDelta] = []  # finishes decided outside `process`

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
        req.prompt_hashes = self.cache.announce(req.input_ids, req.namespace)
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
            req = self.running.get(rid)
            if req is None:
                return None
            self._leave_running(req)
        req.status = Status.FINISHED
        req.finish_reason = "abort"
        return self._delta(req, [])

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ------------------------------------------------------------------ scheduling
    def next_batch(self, now: float | None = None) -> ScheduledBatch | None:
        now = time.time() if now is None else now
        while True:
            decode, chunking, decode_pages = self._decode_with_room()
            adder = self._admit(now, decode, chunking, decode_pages)
            if decode or adder.reqs or not self.running:
                break
            self._unstick()
        prefill, takes = adder.reqs, adder.takes
        if not decode and not prefill:
            return None
        for req in prefill:
            if req.status is not Status.RUNNING:
                self.run_set.add(req)
        slots = self.kv.allocate(prefill, takes, decode, decode_pages)
        reqs = prefill + decode
        drafts = [self._take_draft(r, t) for r, t in zip(prefill, takes)]
        drafts += [[] for _ in decode]
        token_ids: list[list[int] | None] = [r.fill_ids[r.kv_len:r.kv_len + t - len(d)] + d
                                             for r, t, d in zip(prefill, takes, drafts)]
        token_ids += [None] * len(decode)
        extend_lens = takes + [1] * len(decode)
        prefix_lens = [r.kv_len for r in reqs]
        sample = [r.kv_len + t - len(d) == r.seq_len
                  for r, t, d in zip(prefill, takes, drafts)] + [True] * len(decode)
        for req, n, wants in zip(reqs, extend_lens, sample):
            req.kv_len += n          # the pages are the request's from now on
            req.pending += wants     # its token exists once the step has run
            req.decoding = req.decoding or wants
        mode = ForwardMode.EXTEND if prefill else ForwardMode.DECODE
        return ScheduledBatch(mode, reqs, token_ids, prefix_lens, extend_lens, slots, sample,
                              [r.run_epoch for r in reqs], drafts)

    @staticmethod
    def _take_draft(req: Req, take: int) -> list[int]:
        """The part of the request's draft that fits in this step's `take` tokens (after its
        one uncomputed token); the draft moves into the batch."""
        if not req.draft:
            return []
        draft, req.draft = req.draft[:take - req.uncomputed], []
        return draft

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the in-flight one's tokens are on the
        host: not when a running request's sampling reads its own past tokens (penalties), nor
        when KV is short (a retraction or an outgrown request must see every token first)."""
        # each running request's next token takes at most one page
        return not self.run_set.need_host_tokens and len(self.running) <= self.kv.room()

    def _decode_with_room(self) -> tuple[list[Req], list[Req], int]:
        """Decoding requests (their pages ensured), prompts mid-prefill, and the pages the
        decoding requests' next tokens take."""
        decode, chunking = self.run_set.split()
        while decode and self.kv.decode_pages(decode) > self.kv.room():
            victim = self.run_set.youngest()
            if len(self.running) == 1:
                # Alone and still out of pages: its sequence outgrew this worker's KV.
                self._finish_now(victim, "length")
            else:
                self._retract(victim)
            (decode if victim in decode else chunking).remove(victim)
        return decode, chunking, self.kv.decode_pages(decode)

    def _admit(self, now: float, decode: list[Req], chunking: list[Req],
               decode_pages: int) -> PrefillAdder:
        cfg = self.config
        adder = PrefillAdder(
            self.kv, self.waiting, token_budget=cfg.max_prefill_tokens - len(decode),
            room=self.kv.room() - decode_pages,
            reserved=self.run_set.reserved_pages(), chunk=cfg.chunked_prefill_size,
            max_running=cfg.max_running_requests, num_running=len(self.running),
            ratio=self.run_set.new_token_ratio, now=now)
        adder.continue_chunks(chunking)
        if adder.may_admit():
            self.waiting.offer(now, cfg.max_queue_wait_s, adder.decide)
        return adder

    def _unstick(self) -> None:
        """Every running request extends (a prompt mid-prefill, forced or draft tokens) and none
        has room: retract the youngest. Alone with output, it has outgrown this worker's KV as a
        decoding request does ("length"); alone without, its prompt can never fit: refuse it."""
        victim = self.run_set.youngest()
        if len(self.running) > 1:
            self._retract(victim)
        elif victim.output_ids:
            self._finish_now(victim, "length")
        else:
            self._finish_now(victim, "abort", error=f"the request needs more KV than this "
                                                    f"worker has ({self.pool.capacity} tokens)")

    def _leave_running(self, req: Req) -> None:
        self.run_set.remove(req)
        self.waiting.unpark(req.rid)   # requests held behind its prefill re-match the tree

    def _finish_now(self, req: Req, reason: str, error: str | None = None) -> None:
        self._pending_deltas.append(self._ended(req, reason, error))

    def _ended(self, req: Req, reason: str, error: str | None) -> TokenDelta:
        self._leave_running(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        delta = self._delta(req, [])
        delta.error = error
        return delta

    def _constraint_failed(self, req: Req, exc: Exception) -> TokenDelta:
        """The grammar library raised on this request: it ends, with the reason; the batch and
        the engine go on (a crash here would end every request, and a gateway or client retry
        would take the same request to the next worker)."""
        kind = req.params.constraint[0] if req.params.constraint else "the output constraint"
        log.warning("request %s: the grammar library failed on its %s", req.rid, kind,
                    exc_info=exc)
        return self._ended(req, "abort", f"{kind} could not be followed: the grammar library "
                                         f"failed on it ({type(exc).__name__}: {exc})")

    def _nonfinite(self, req: Req) -> TokenDelta:
        """The model gave this request's row NaN or infinite logits: its token would be garbage
        and its logprobs NaN. It ends with the reason, without that token; the batch goes on
        (its rows were sampled independently)."""
        self.nonfinite_total += 1
        req.kv_suspect = True
        log.error("request %s: the model produced non-finite logits (NaN or infinity) at "
                  "output token %d; the request is aborted", req.rid, len(req.output_ids))
        delta = self._ended(req, "abort", "the model produced non-finite logits (NaN or "
                                          "infinity) for this request; it was aborted")
        delta.internal_error, delta.error_code = True, NONFINITE_LOGITS
        return delta

    def _retract(self, req: Req) -> None:
        self._leave_running(req)
        req.retractions += 1
        self.retracted_total += 1
        self.run_set.on_retract()
        self.waiting.push(req)

    # ------------------------------------------------------------------ results
    def process(self, batch: ScheduledBatch, sampled: list[int],
                logprobs: list | None = None, top_logprobs: list | None = None) -> list[TokenDelta]:
        """Apply one step's results. `sampled[j]` belongs to the j-th request with sample=True."""
        deltas = self.take_deltas()
        j = 0
        extend = batch.mode is ForwardMode.EXTEND
        for req, n, wants, epoch, draft in zip(batch.reqs, batch.extend_lens, batch.sample,
                                               batch.epochs, batch.drafts):
            first, j = j, j + wants + len(draft)
            if req.run_epoch != epoch:
                continue  # finished, aborted or retracted after this step was scheduled
            req.pending -= wants
            if not wants:
                self.kv.cache_prefix(req)  # a finished chunk becomes shareable now
                continue
            if NONFINITE in sampled[first:j]:
                deltas.append(self._nonfinite(req))
                continue
            if draft:
                tokens = commit(draft, sampled[first:j])
                # the KV of rejected draft tokens goes; the last emitted one has none yet
                self.kv.truncate(req, req.kv_len - (len(draft) + 1 - len(tokens)))
                self.jump_forward_tokens += len(tokens) - 1
                first = j - 1   # (logprobs: a request with a draft never asks for them)
            else:
                tokens = [sampled[first]]
            for token in tokens:
                req.append(token)
            if req.grammar is not None:
                try:
                    tokens = self._follow_grammar(req, tokens, verified=bool(draft))
                except Exception as exc:
                    deltas.append(self._constraint_failed(req, exc))
                    continue
            if self._check_finished(req, tokens[-1]):
                self._leave_running(req)
            elif (n > 1 and not draft) or len(req.output_ids) == 1:
                # a prompt's end or retokenized forced text becomes shareable now; a verified
                # draft's tokens, like decoded ones, go into the tree when the request leaves
                self.kv.cache_prefix(req)
            if extend:
                self.waiting.unpark(req.rid)   # its prompt is in the tree now
            deltas.append(self._delta(req, tokens, None if logprobs is None else logprobs[first],
                                      None if top_logprobs is None else top_logprobs[first]))
        if batch.mode is ForwardMode.DECODE:
            self.run_set.on_decode_step()
        return deltas

    def _follow_grammar(self, req: Req, tokens: list[int], verified: bool) -> list[int]:
        """Advance the request's grammar past the tokens just appended (a sampled token, or a
        verified draft's). Then, by jump-forward mode: "exact" drafts the text the grammar
        forces for the next step to verify; "retokenize" appends it (the sampled token maybe
        re-split with it). Returns the tokens that now end the output in their place."""
        grammar = req.grammar
        if grammar.failure is not None:   # raised while its mask was filled
            raise grammar.failure
        for token in tokens:
            if not grammar.accept(token):
                # Only a grammar with no allowed token left gets here (the sampler gave it eos).
                req.finish_reason = "stop"
                return tokens
        mode, p = self.config.jump_forward, req.params
        if verified:
            # it decodes next from its row's device-side last token: the one emitted, which is
            # not the step's last position's choice unless the whole draft was accepted
            self.rows.last_token[req.row] = tokens[-1]
        if grammar.terminated or mode == "off" or p.logprobs is not None:
            return tokens   # (forced tokens would have no logprobs)
        budget = min(req.remaining_new_tokens(), self.context_length - req.seq_len)
        if mode == "exact":
            stops = self.eos_token_ids | set(p.stop_token_ids)
            req.draft = propose_draft(grammar, budget - 1, stops)
            return tokens
        token = tokens[-1]
        forced = grammar.jump_forward(token, budget + 1)
        if forced is None:
            return tokens
        req.replace_last(forced)
        # Whatever step computes the forced tokens' KV, the last of them may go alone as a
        # decode, which reads its input from the row's device-side last token (a chunked extend
        # leaves one over; so does KV pressure): it must be the forced token, not the sampled one.
        self.rows.last_token[req.row] = forced[-1]
        self.jump_forward_tokens += len(forced) - 1
        return [*tokens[:-1], *forced]

    def take_deltas(self) -> list[TokenDelta]:
        """Finishes decided while scheduling (a request that outgrew the KV, or can never fit):
        `process` returns them too; a caller with no batch to process takes them here."""
        deltas, self._pending_deltas = self._pending_deltas, []
        return deltas

    def _check_finished(self, req: Req, token: int) -> bool:
        p = req.params
        n = len(req.output_ids)
        stops = (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        if req.grammar is not None and req.grammar.terminated:
            # the grammar accepted a stop token: the output is complete, and has no next token
            # (even short of min_new_tokens: the sampler gave eos to a row with nothing allowed)
            req.finish_reason = "stop"
        if (stops and n >= p.min_new_tokens) or req.finish_reason == "stop":
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

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Every page free, cached or owned by exactly one running request; locks balanced;
        waiting requests hold nothing."""
        self.kv.check(list(self.running.values()))
        for req in self.waiting.members():
            assert req.row is None and req.last_node is None, f"waiting {req.rid} holds KV"
