"""A stand-in with the `Engine` interface the server uses, for testing the HTTP layer in-process.

It "generates" deterministic tokens (a function of the prompt, the seed and the position), keeps
every finished sequence as its cache, and logs KV events like the real front end. It models
nothing of the scheduler; behaviour of the real engine is tested against real worker processes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from radixpool.protocol.kv_blocks import KVEvent, prefix_block_hashes
from radixpool.tokenization import PromptTokenizer
from radixpool.worker.messages import CoreReady, EngineStats
from radixpool.worker.sampling_params import SamplingParams


@dataclass
class Chunk:
    rid: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list | None
    finished: bool
    finish_reason: str | None
    matched_stop: str | int | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    arrival_time: float
    first_token_time: float | None
    queue_time: float | None


class FakeEventLog:
    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self.cond = asyncio.Condition()

    @property
    def last_seq(self) -> int:
        return self.events[-1].seq if self.events else 0

    def append(self, kind: str, blocks: tuple[int, ...] = ()) -> None:
        self.events.append(KVEvent(self.last_seq + 1, kind, blocks))

    def events_since(self, seq: int) -> list[KVEvent] | None:
        return [e for e in self.events if e.seq > seq]

    async def wait(self, seq: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.last_seq <= seq and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


class FakeEngine:
    def __init__(self, model_path: str, context_length: int = 256) -> None:
        self.tokenizer = PromptTokenizer.from_dir(model_path)
        self.info = CoreReady(model_path, "Fake", context_length, self.tokenizer.vocab_size,
                              4096, 1, 16, (2,), "cpu", "float32", "fake")
        self.instance_id = uuid.uuid4().hex
        self.cache: list[list[int]] = []
        self.kv_events = FakeEventLog()
        self.running = 0

    def _cached(self, ids: list[int]) -> int:
        best = 0
        for seq in self.cache:
            n = 0
            while n < min(len(seq), len(ids)) and seq[n] == ids[n]:
                n += 1
            best = max(best, n)
        return best

    async def stream(self, input_ids, sampling_params, namespace=None, rid=None):
        params = (sampling_params if isinstance(sampling_params, SamplingParams)
                  else SamplingParams.from_dict(sampling_params))
        if len(input_ids) >= self.info.context_length:
            raise ValueError("prompt is too long")
        arrival = time.time()
        cached = self._cached(input_ids)
        self.running += params.n
        try:
            for fork in range(params.n):
                seed = params.seed or 0
                out: list[int] = []
                for step in range(params.max_new_tokens):
                    await asyncio.sleep(0)
                    token = 3 + (sum(input_ids) + seed * 7 + step * 13 + fork) % 200
                    out.append(token)
                    done = step + 1 == params.max_new_tokens
                    yield Chunk(rid or "r", fork, self.tokenizer.decode([token]), [token],
                                [-0.5] if params.logprobs is not None else None,
                                [[(token, -0.5)] * params.logprobs] if params.logprobs else None,
                                done, "length" if done else None, None, len(input_ids), cached,
                                len(out), arrival, arrival, 0.0)
            full = list(input_ids)
            self.cache.append(full)
            blocks = tuple(int(h) for h in prefix_block_hashes(full, 16, namespace))
            if blocks:
                self.kv_events.append("stored", blocks)
        finally:
            self.running -= params.n

    async def generate_async(self, input_ids, sampling_params, namespace=None):
        async for chunk in self.stream(input_ids, sampling_params, namespace):
            last = chunk
        return {"text": last.text}

    def probe(self, input_ids, namespace=None) -> int:
        return self._cached(list(input_ids))

    def stats(self) -> EngineStats:
        return EngineStats(self.running, 0, 4096, self.running, sum(map(len, self.cache)), 0, 0, 0)

    def kv_snapshot(self):
        hashes = [int(h) for seq in self.cache for h in prefix_block_hashes(seq, 16)]
        return self.kv_events.last_seq, hashes

    def flush_cache(self) -> None:
        self.cache.clear()
        self.kv_events.append("cleared")
        self.instance_id = uuid.uuid4().hex

    def abort(self, rid: str) -> None:
        pass

    def shutdown(self) -> None:
        pass
