"""Turning the core's token deltas into what callers see: text chunks and final results.

One `RequestOutput` per core request (one of a request's n choices) lives where the engine reads
the core's output (its receiver thread, or a server's event loop). It detokenizes incrementally
(never a partial UTF-8 character), applies stop strings (held back while they might still match,
trimmed when they do) and builds `StreamChunk`s.

A stop token (`stop_token_ids`, or EOS when not ignored) that ends the output stays in its token
ids and counts, but its text is not in the text (as in vLLM and SGLang), unless `no_stop_trim`:
the text is that of the tokens before it, so bytes the detokenizer held for a character the stop
token would have completed come out as they decode alone (U+FFFD), as SGLang decodes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from radixpool.worker.detokenizer import IncrementalDetokenizer
from radixpool.worker.engine_errors import RequestFault
from radixpool.worker.messages import GenerateRequest, TokenDelta
from radixpool.worker.sampling_params import SamplingParams
from radixpool.worker.stop_strings import StopMatcher


@dataclass
class StreamChunk:
    rid: str
    index: int                      # which of the n choices
    text: str                       # new text since the previous chunk
    token_ids: list[int]            # new tokens since the previous chunk
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    trimmed_stop_token: int | None = None   # ended the output (the last id); its text is not here
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    queue_time: float | None = None
    error: str | None = None        # the core refused the request (bad input) or was lost
    internal_error: bool = False    # True when the engine, not the input, was at fault
    error_code: str | None = None   # an engine fault of this request alone (protocol.errors)
    core_seconds: float | None = None   # on the last chunk: time in the engine core

    def raise_error(self) -> None:
        if self.error is None:
            return
        if self.internal_error and self.error_code is not None:
            raise RequestFault(self.error, self.error_code)
        raise (RuntimeError if self.internal_error else ValueError)(self.error)


@dataclass
class RequestOutput:
    core_rid: str
    rid: str
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    stop: StopMatcher | None
    sink: Callable[[StreamChunk], None]
    arrival_time: float
    output_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    finished: bool = False
    deferred: list[GenerateRequest] = field(default_factory=list)  # sibling forks, sent later

    def apply(self, delta: TokenDelta) -> tuple[StreamChunk, bool]:
        """The chunk for this delta, and whether a stop string just ended the output."""
        if delta.error is not None:
            return self.fail("abort", delta.error, internal=delta.internal_error,
                             prompt_tokens=delta.prompt_tokens, code=delta.error_code), False
        tokens = delta.token_ids
        if tokens and self.first_token_time is None:
            self.first_token_time = time.time()
        # The core ends a delta with the stop token it matched: its text is left out.
        trimmed = (delta.finished and bool(tokens) and not self.params.no_stop_trim
                   and delta.matched_stop_token == tokens[-1])
        shown = tokens[:-1] if trimmed else tokens
        # The first min_new_tokens - 1 tokens cannot end the output with a stop string (the
        # core already bans EOS and stop tokens there): their text is fed as "may not stop".
        quiet = min(len(shown), max(0, self.params.min_new_tokens - 1 - len(self.output_ids)))
        self.output_ids.extend(tokens)
        parts = [[self.detok.push(shown[:quiet]), False]] if quiet else []
        if quiet < len(shown) or not parts:
            parts.append([self.detok.push(shown[quiet:]), True])
        if delta.finished:
            parts[-1][0] += self.detok.flush()
        reason, matched, stopped = delta.finish_reason, delta.matched_stop_token, False
        if self.stop is None:
            text = "".join(part for part, _ in parts)
        else:
            text = ""
            for part, may_stop in parts:
                check = self.stop.feed(part, may_stop)
                text += check.text
                if check.stop is not None:
                    reason, matched, stopped = "stop", check.stop, True
                    break
            if delta.finished and not stopped:
                text += self.stop.flush()
        self.finished = delta.finished or stopped
        return StreamChunk(
            rid=self.rid, index=self.index, text=text, token_ids=list(delta.token_ids),
            finished=self.finished, finish_reason=reason if self.finished else None,
            matched_stop=matched if self.finished else None,
            trimmed_stop_token=tokens[-1] if trimmed and not stopped else None,
            logprobs=delta.logprobs, top_logprobs=delta.top_logprobs,
            prompt_tokens=delta.prompt_tokens, cached_tokens=delta.cached_tokens,
            completion_tokens=len(self.output_ids), arrival_time=self.arrival_time,
            first_token_time=self.first_token_time, queue_time=delta.queue_time,
            core_seconds=delta.core_seconds), stopped

    def fail(self, reason: str, error: str | None, internal: bool,
             prompt_tokens: int = 0, code: str | None = None) -> StreamChunk:
        """The final chunk of a request the core refused or lost."""
        self.finished = True
        return StreamChunk(
            rid=self.rid, index=self.index, text="", token_ids=[], finished=True,
            finish_reason=reason, completion_tokens=len(self.output_ids),
            prompt_tokens=prompt_tokens, arrival_time=self.arrival_time,
            error=error, internal_error=internal, error_code=code)


def result_from_chunks(chunks: list[StreamChunk]) -> dict:
    """The offline result dict of one choice, from all its chunks."""
    if not chunks:
        return {"text": "", "output_ids": [], "meta_info": {"finish_reason": "abort"}}
    last = chunks[-1]
    meta = {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "cached_tokens": last.cached_tokens, "finish_reason": last.finish_reason,
            "matched_stop": last.matched_stop}
    if any(c.logprobs for c in chunks):
        meta["logprobs"] = [lp for c in chunks for lp in (c.logprobs or [])]
        meta["top_logprobs"] = [t for c in chunks for t in (c.top_logprobs or [])]
    return {"text": "".join(c.text for c in chunks),
            "output_ids": [t for c in chunks for t in c.token_ids], "meta_info": meta}
