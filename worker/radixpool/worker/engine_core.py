"""The engine core: scheduler + model runner + sampler, one step at a time, no I/O.

`core_process.py` runs it in its own process behind a socket pair; tests drive it directly. A
step asks the scheduler for a batch, runs the forward pass, samples the requests that reached the
end of what they had to compute, and lets the scheduler apply the tokens. What changed (new
tokens, finishes, cache events, queue stats) comes back as one `StepOutput`.

Overlapped (`overlap_schedule`, the default on CUDA): a step schedules and launches batch N+1
*before* processing batch N's results, so the host's bookkeeping runs while the device computes.
The sampled tokens stay on the device (each row's `last_token`, where the next decode reads its
input) until `process` needs them; lengths and KV ownership advanced when N was scheduled, and
results of requests that left the running set since are dropped (`Req.run_epoch`). When the next
batch depends on tokens the host has not seen — penalties read past tokens, a KV shortage must
see every token before it retracts or finishes a request — the step processes N first, exactly
like the synchronous loop. Either way a request gets the same tokens.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from radixpool.protocol.kv_blocks import DEFAULT_BLOCK_SIZE, KVEvent
from radixpool.worker.config import EngineConfig
from radixpool.worker.device_copy import to_device
from radixpool.worker.forward_batch import ForwardBatch
from radixpool.worker.grammar.compiler import GrammarCompiler
from radixpool.worker.grammar.mask import GrammarMasks
from radixpool.worker.grammar.queue import GrammarQueue
from radixpool.worker.mem.radix_cache import RadixCache
from radixpool.worker.messages import (
    CoreReady,
    EngineStats,
    GenerateRequest,
    StepOutput,
    TokenDelta,
)
from radixpool.worker.model_runner import ModelRunner
from radixpool.worker.request import Req
from radixpool.worker.sampler import Sampler, SampleResult, SamplingRow
from radixpool.worker.sampling_params import SamplingParams
from radixpool.worker.scheduler.scheduler import ScheduledBatch, Scheduler

log = logging.getLogger("radixpool.core")


@dataclass
class StepTimes:
    """Cumulative wall time per phase of `step`, in seconds (for benchmarks and profiling)."""

    schedule: float = 0.0   # choosing the batch, allocating KV, building the forward batch
    forward: float = 0.0    # the model
    sample: float = 0.0
    process: float = 0.0    # applying tokens: finishes, cache inserts, lock hand-over, events
    # The part of `process` spent blocked reading the sampled tokens off the device: on a GPU
    # the host waits there for the forward and sampling to end, so it is not host work.
    wait: float = 0.0
    steps: int = 0

    @property
    def bookkeeping(self) -> float:
        return self.schedule + self.process


@dataclass
class InFlight:
    """A launched step whose results are not processed yet."""

    batch: ScheduledBatch
    result: SampleResult | None


GRAMMAR_WAIT_S = 0.01   # an idle core waits this long for a compile before looking at its inbox
WARMUP_OUTPUT_TOKENS = 4   # each warm-up request decodes this many: graph and eager steps
WARMUP_MAX_STEPS = 256


def kv_block_size(page_size: int) -> int:
    """Event block size: the protocol default, rounded up to whole pages."""
    return -(-DEFAULT_BLOCK_SIZE // page_size) * page_size


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self._fresh_cache_and_scheduler()
        # Penalty counts for as many requests as the memory plan reserved (all of it on GPU).
        self.sampler = Sampler(self.runner.vocab_size, self.runner.eos_token_ids,
                               self.runner.device,
                               max_penalty_requests=self.runner.per_request.penalty_rows,
                               preallocate=self.runner.device.type == "cuda")
        self.times = StepTimes()
        overlap = config.overlap_schedule
        self.overlap = self.runner.device.type == "cuda" if overlap is None else overlap
        self._inflight: InFlight | None = None
        self.grammars = GrammarQueue(GrammarCompiler(config.model_path, self.runner.vocab_size,
                                                     tuple(self.runner.eos_token_ids)),
                                     config.grammar_compile_timeout_s)
        self._masks: GrammarMasks | None = None

    def _fresh_cache_and_scheduler(self) -> None:
        config, runner = self.config, self.runner
        self.cache = RadixCache(runner.kv_pool, config.page_size, kv_block_size(config.page_size),
                                config.eviction_policy)
        self.scheduler = Scheduler(config, runner.kv_pool, runner.req_to_token_pool, self.cache,
                                   runner.context_length, runner.eos_token_ids)

    def ready_message(self, warmup_seconds: float = 0.0) -> CoreReady:
        r = self.runner
        return CoreReady(
            model_path=self.config.model_path, architecture=r.architecture,
            context_length=r.context_length, vocab_size=r.vocab_size,
            kv_capacity_tokens=r.kv_pool.capacity, page_size=self.config.page_size,
            kv_block_size=self.cache.block_size, eos_token_ids=tuple(r.eos_token_ids),
            device=str(r.device), dtype=str(r.dtype).removeprefix("torch."),
            attention_backend=r.attention_backend_name, stats=self.stats(),
            warmup_seconds=warmup_seconds, sampling_defaults=dict(r.sampling_defaults))

    # ------------------------------------------------------------------ warm-up
    @torch.inference_mode()
    def warm_up(self) -> int:
        """Run the kernels a first request would, before the worker says it is ready.

        On a GPU the first call of a kernel may compile it (FlashInfer builds missing kernels
        just in time, which needs a compiler the image may lack), autotune it or load its
        module: without this the first user's request pays for it, or fails. Two requests run:
        a fresh prefill (greedy), then one over the first's cached prefix with the sampling
        paths (top-k/top-p/min-p, penalties, logprobs), each decoding a few tokens. Afterwards
        the radix cache and scheduler start over (empty tree, event sequence from 1, zero
        counters), so nothing the clients or gateway see depends on it. The grammar compiler
        starts building its view of the tokenizer (seconds for a real one) in the background,
        so the first constrained request does not wait for it. Returns the steps run.
        An exception is a fault the first request would have met: the worker must not start.
        """
        page = self.config.page_size
        # the prompts this worker takes: shorter than its context and than its KV pool
        room = min(self.runner.context_length, self.runner.kv_pool.capacity)
        prompt_room = max(1, room - WARMUP_OUTPUT_TOKENS)
        first_len = max(1, min(2 * page + 3, prompt_room // 2))
        second_len = min(first_len + page + 1, prompt_room)
        vocab = self.runner.vocab_size
        ids = [(7 * i + 3) % vocab for i in range(second_len)]
        greedy = SamplingParams(max_new_tokens=WARMUP_OUTPUT_TOKENS, temperature=0.0,
                                ignore_eos=True)
        sampled = SamplingParams(max_new_tokens=WARMUP_OUTPUT_TOKENS, temperature=0.8,
                                 top_p=0.9, top_k=20, min_p=0.01, frequency_penalty=0.1,
                                 presence_penalty=0.1, repetition_penalty=1.1, logprobs=2,
                                 ignore_eos=True)
        # grammars' view of the tokenizer builds meanwhile, on the compile thread
        self.grammars.compiler.prepare()
        steps = 0
        for i, (params, length) in enumerate(((greedy, first_len), (sampled, second_len))):
            rid = f"warmup-{i}"
            refused = self.add_request(GenerateRequest(rid, ids[:length], params, seed=i))
            if refused is not None:   # a setting this small refuses any request alike
                log.warning("warm-up skipped: the engine refused a %d-token request: %s",
                            length, refused.error)
                break
            done = False
            while not done:
                if steps >= WARMUP_MAX_STEPS:
                    raise RuntimeError(f"warm-up request {rid} did not finish in "
                                       f"{WARMUP_MAX_STEPS} steps")
                steps += 1
                out = self.step()
                for d in out.deltas:
                    if d.rid == rid and d.finished:
                        done = True
                        if d.error:   # e.g. non-finite logits: the first client would meet it
                            log.warning("warm-up request %s ended with an error: %s", rid,
                                        d.error)
        while self._inflight is not None:
            self.step()
        self.flush_cache()
        if self.config.debug_invariants:
            self.check_invariants()
        self._fresh_cache_and_scheduler()
        self.times = StepTimes()
        return steps

    # ------------------------------------------------------------------ intake
    def add_request(self, msg: GenerateRequest) -> TokenDelta | None:
        """Queue a request; returns an error delta if the core refuses it."""
        try:
            msg.params.check_vocab(self.runner.vocab_size)
            ids = msg.input_ids   # min/max run in C: no per-token bytecode on long prompts
            if ids and (min(ids) < 0 or max(ids) >= self.runner.vocab_size):
                raise ValueError("input_ids contain a token id outside the vocabulary")
        except ValueError as exc:
            return TokenDelta(msg.rid, [], finished=True, finish_reason="abort",
                              prompt_tokens=len(msg.input_ids), error=str(exc))
        req = Req(rid=msg.rid, input_ids=list(msg.input_ids), params=msg.params, seed=msg.seed,
                  namespace=msg.namespace, arrival_time=msg.arrival_time or time.time())
        if msg.params.constraint is not None:
            self.grammars.add(req)   # joins the scheduler once its grammar is compiled
            return None
        return self.scheduler.add(req)

    def drain_events(self) -> list[KVEvent]:
        """The cache's events since the last drain, for the front end's KV stream; the waiting
        queue hears which blocks were stored (it ranks requests by their cached prefix)."""
        events = self.cache.drain_events()
        for event in events:
            if event.type == "stored":
                self.scheduler.waiting.on_stored(event.blocks)
        return events

    def _admit_compiled(self) -> list[TokenDelta]:
        """Constrained requests whose grammar is ready join the scheduler (or are refused)."""
        deltas = []
        for req, error in self.grammars.ready():
            delta = self.scheduler.add(req) if error is None else TokenDelta(
                req.rid, [], finished=True, finish_reason="abort",
                prompt_tokens=len(req.input_ids), error=error)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def abort(self, rid: str) -> TokenDelta | None:
        req = self.grammars.remove(rid)
        if req is not None:
            return TokenDelta(rid, [], finished=True, finish_reason="abort",
                              prompt_tokens=len(req.input_ids))
        delta = self.scheduler.abort(rid)
        if delta is not None:
            self.sampler.release(rid)
        return delta

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None or len(self.grammars) > 0

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def step(self) -> StepOutput:
        out = StepOutput()
        if len(self.grammars):
            if not (self.scheduler.has_work or self._inflight):
                self.grammars.wait(GRAMMAR_WAIT_S)   # nothing else to do meanwhile
            out.deltas += self._admit_compiled()
        previous, self._inflight = self._inflight, None
        if previous is not None and not self.scheduler.can_schedule_ahead():
            out.deltas += self._process(previous)
            previous = None
        t0 = time.perf_counter()
        batch = self.scheduler.next_batch()
        if batch is not None:
            self.times.steps += 1
            launched = self._launch(batch, t0)
            if self.overlap:
                self._inflight = launched
            else:
                out.deltas += self._process(launched)
        if previous is not None:
            out.deltas += self._process(previous)
        # finishes the scheduler decided with no batch to process them (it outgrew the KV)
        out.deltas += self._release_finished(self.scheduler.take_deltas())
        t = time.perf_counter()
        out.events = self.drain_events()
        out.stats = self.stats()
        self.times.process += time.perf_counter() - t
        return out

    def _launch(self, batch: ScheduledBatch, t0: float) -> InFlight:
        """Forward and sample; the tokens stay on the device, in each row's `last_token`."""
        runner, times = self.runner, self.times
        last_tokens = runner.req_to_token_pool.last_token
        draft_lens = [len(d) for d in batch.drafts]
        fb = ForwardBatch.build(batch.mode, batch.token_ids, batch.prefix_lens,
                                batch.out_cache_loc, batch.rows, batch.sample,
                                runner.req_to_token_pool.table, runner.kv_pool, last_tokens,
                                draft_lens if any(draft_lens) else None)
        t1 = time.perf_counter()
        logits = runner.forward(fb)
        t2 = time.perf_counter()
        sampled = [(r, d) for r, wants, d in zip(batch.reqs, batch.sample, batch.drafts) if wants]
        result = None
        if sampled:
            rows, mask_rows, grammars, drafts, last_rows = [], [], [], [], []
            for r, draft in sampled:
                # `pending` already counts this step's token: the step index is one less.
                # Draft position i is sampled as step + i after d1..di (penalty counts
                # recounted for that output: no key).
                step = len(r.output_ids) + r.pending - 1
                if r.grammar is not None:
                    mask_rows.extend(range(len(rows), len(rows) + len(draft) + 1))
                    grammars.append(r.grammar)
                    drafts.append(draft)
                rows.append(SamplingRow(r.params, r.seed, r.input_ids, r.output_ids, r.rid, step))
                rows.extend(SamplingRow(r.params, r.seed, r.input_ids, r.output_ids + draft[:i],
                                        None, step + i) for i in range(1, len(draft) + 1))
                last_rows.append(len(rows) - 1)
            # the forward's logits are this step's alone: the sampler may edit them in place
            mask = self._grammar_masks().build(grammars, drafts) if grammars else None
            # tokens are read in `_process`, overlapped or not, so the wait is timed there
            result = self.sampler.sample(logits, rows, vocab_mask=mask, logits_owned=True,
                                         to_host=False, mask_rows=mask_rows)
            index = to_device([r.row for r, _ in sampled], torch.int64, last_tokens.device)
            # (a verified draft's request gets its real last token when it is processed)
            last_tokens[index] = (result.inputs if len(rows) == len(sampled)
                                  else result.inputs[to_device(last_rows, torch.int64,
                                                               last_tokens.device)])
        times.schedule += t1 - t0
        times.forward += t2 - t1
        times.sample += time.perf_counter() - t2
        return InFlight(batch, result)

    def _grammar_masks(self) -> GrammarMasks:
        if self._masks is None:   # the compiler built the vocabulary before any grammar ran
            self._masks = GrammarMasks(self.grammars.compiler.vocab, self.runner.vocab_size,
                                       self.runner.device)
        return self._masks

    def _process(self, done: InFlight) -> list[TokenDelta]:
        t = time.perf_counter()
        result = done.result
        if result is None:
            deltas = self.scheduler.process(done.batch, [])
        else:
            if result.token_ids is not None:
                tokens = result.token_ids
            else:
                w = time.perf_counter()
                tokens = result.tensor.tolist()
                self.times.wait += time.perf_counter() - w
            deltas = self.scheduler.process(done.batch, tokens, result.logprobs,
                                            result.top_logprobs)
        self._release_finished(deltas)
        self.times.process += time.perf_counter() - t
        return deltas

    def _release_finished(self, deltas: list[TokenDelta]) -> list[TokenDelta]:
        """The sampler forgets the penalty counts of every request `deltas` finish."""
        for delta in deltas:
            if delta.finished:
                self.sampler.release(delta.rid)
        return deltas

    # ------------------------------------------------------------------ control
    def busy_counts(self) -> dict[str, int] | None:
        """`{"running": r, "waiting": w}` while any request is queued or running; else None."""
        sched = self.scheduler
        if not sched.has_work:
            return None
        return {"running": len(sched.running), "waiting": len(sched.waiting)}

    def flush_cache(self) -> list[TokenDelta]:
        """Empty the radix cache. Only while no request is queued or running: they hold locks
        into it. A step still in flight (its requests all left) is processed first; its
        deltas are returned."""
        if self.scheduler.has_work:
            raise RuntimeError("cannot flush while requests are running or waiting")
        previous, self._inflight = self._inflight, None
        deltas = self._process(previous) if previous is not None else []
        self.cache.reset()
        return deltas

    def probe(self, input_ids: list[int], namespace: str | None = None) -> int:
        return self.cache.probe(input_ids, namespace)

    def stats(self) -> EngineStats:
        pool, cache, sched = self.runner.kv_pool, self.cache, self.scheduler
        compiler = self.grammars.compiler
        return EngineStats(
            running=len(sched.running), waiting=len(sched.waiting) + len(self.grammars),
            kv_capacity_tokens=pool.capacity,
            kv_used_tokens=pool.capacity - pool.available_size(),
            radix_cache_tokens=cache.total_size, evictable_tokens=cache.evictable_size,
            retracted_total=sched.retracted_total, evicted_tokens_total=cache.evicted_tokens_total,
            kv_double_frees_total=pool.double_frees,
            grammar_compile_buckets=tuple(itertools.accumulate(compiler.compile_counts)),
            grammar_compile_seconds_sum=compiler.compile_seconds_sum,
            grammar_cache_hits_total=compiler.cache_hits,
            nonfinite_logits_total=sched.nonfinite_total)

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
