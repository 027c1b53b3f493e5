"""`/v1/chat/completions`, `/v1/completions` and `/v1/models`, OpenAI-compatible.

Prompt tokens are counted once per prompt (not per choice), completion tokens summed over choices,
and `prompt_tokens_details.cached_tokens` is what the radix cache held when the request arrived
(the least over the request's choices: later forks reuse the first one's prefill).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from radixpool.worker.server.errors import stream_error
from radixpool.worker.server.generation import (
    EngineRun,
    ForkOutput,
    build_params,
    merge_streams,
    server_timing,
    start_all,
    until_disconnect,
)
from radixpool.worker.server.logprobs import (
    TextCover,
    TextOffset,
    TokenEntry,
    chat_logprobs,
    completion_logprobs,
)
from radixpool.worker.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixpool.worker.server.request_checks import chat_prompt_field
from radixpool.worker.server.sse import DONE, EventStream, sse
from radixpool.worker.server.state import WorkerState
from radixpool.worker.server.tool_use import ToolUse, stream_finish_reason

CHAT_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                "logprobs": "top_logprobs", "json_schema": "response_format"}
COMPLETION_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                      "json_schema": "response_format"}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class UsageTally:
    """Usage over the prompts of one request, each with its forks."""

    def __init__(self, prompt_lengths: list[int]) -> None:
        self.prompt_lengths = prompt_lengths
        self.cached: dict[int, int] = {}
        self.completion: dict[tuple[int, int], int] = {}

    def add(self, prompt_index: int, chunk: Any) -> None:
        cached = self.cached.get(prompt_index)
        if chunk.token_ids:   # an abort before admission carries no cache hit
            self.cached[prompt_index] = (chunk.cached_tokens if cached is None
                                         else min(cached, chunk.cached_tokens))
        self.completion[(prompt_index, chunk.index)] = chunk.completion_tokens

    def add_fork(self, prompt_index: int, fork: ForkOutput) -> None:
        cached = self.cached.get(prompt_index, fork.cached_tokens)
        self.cached[prompt_index] = min(cached, fork.cached_tokens)
        self.completion[(prompt_index, fork.index)] = fork.completion_tokens

    def doc(self) -> dict:
        return usage(sum(self.prompt_lengths), sum(self.completion.values()),
                     sum(self.cached.values()))


def ends_inside_tokens(finish_reason: str | None, matched_stop: str | int | None) -> bool:
    """Whether a choice's text ends inside its tokens' text: a stop string cut it, or it was
    aborted with text held back."""
    return isinstance(matched_stop, str) or finish_reason == "abort"


def chunk_entries(state: WorkerState, cover: TextCover, chunk: Any, text: str, end: bool,
                  skip_special_tokens: bool) -> list[TokenEntry]:
    """The logprob entries `cover` releases for a stream's chunk or a whole answer (a
    `ForkOutput`, `end` True): those its text so far covers."""
    return cover.take(chunk.token_ids, chunk.logprobs or [], chunk.top_logprobs, text,
                      state.token_text.skipped(skip_special_tokens, chunk.trimmed_stop_token),
                      end=end, cut=ends_inside_tokens(chunk.finish_reason, chunk.matched_stop))


def fork_entries(state: WorkerState, fork: ForkOutput, text: str,
                 skip_special_tokens: bool) -> list[TokenEntry]:
    """The logprob entries of a whole answer's tokens that its text covers."""
    return chunk_entries(state, TextCover(state.token_text), fork, text, True,
                         skip_special_tokens)


def router(state: WorkerState) -> APIRouter:
    r = APIRouter()

    def model_card() -> dict:
        return {"id": state.config.served_model_name, "object": "model",
                "created": state.started_at, "owned_by": "radixpool",
                "root": state.config.engine.model_path,
                "max_model_len": state.engine.info.context_length}

    @r.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @r.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        state.check_model(model)
        return model_card()

    @r.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state.check_model(body.model)
        messages = body.template_messages
        tools = await ToolUse.of(body, messages, state.tool_format)
        template_kwargs = dict(body.chat_template_kwargs or {})
        if tools.rendered is not None:
            template_kwargs["tools"] = tools.rendered
        input_ids = await state.encode_chat(messages, body.add_generation_prompt, template_kwargs,
                                            body.template_kwarg_chars)
        max_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        prompt_field = chat_prompt_field(messages, body.template_kwarg_chars)
        max_new = state.token_budget(len(input_ids), body.requested_max_tokens, prompt_field,
                                     max_param)
        tools = await tools.with_grammar(body)
        sampling = body.sampling_dict(max_new, body.logprobs_k)
        if tools.grammar is not None:
            sampling["ebnf"] = tools.grammar
        params = build_params(sampling, state.vocab_size, CHAT_RENAMES,
                              defaults=state.sampling_defaults)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        run = EngineRun(state, input_ids, params, body.cache_salt, rid, CHAT_RENAMES, prompt_field)
        await start_all(request, [run])
        created = int(time.time())
        head = {"id": rid, "created": created, "model": state.config.served_model_name}
        if body.stream:
            return EventStream(_chat_events(state, run, body, head, len(input_ids), tools))
        forks = await until_disconnect(request, run.collect(), [run])
        tally = UsageTally([len(input_ids)])
        choices = []
        for fork in forks:
            tally.add_fork(0, fork)
            message, finish_reason = tools.message(fork.full_text, fork.finish_reason)
            choices.append({
                "index": fork.index,
                "message": message,
                "logprobs": (chat_logprobs(state.token_text, fork_entries(
                    state, fork, fork.full_text, params.skip_special_tokens))
                             if params.logprobs is not None else None),
                "finish_reason": finish_reason,
            })
        return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                             "usage": tally.doc(), "system_fingerprint": None},
                            headers=server_timing(forks))

    @r.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        state.check_model(body.model)
        # an empty or too big batch, and echo with logprobs, failed validation
        prompts = body.prompts()
        inputs: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                ids = await state.encode(prompt, param)
            else:
                ids = prompt
                state.check_token_ids(ids, param)
            state.token_budget(len(ids), body.max_tokens, param, "max_tokens")
            inputs.append(ids)
        params = build_params(body.sampling_dict(body.max_tokens or 16, body.logprobs),
                              state.vocab_size, COMPLETION_RENAMES,
                              defaults=state.sampling_defaults)
        rid = f"cmpl-{uuid.uuid4().hex}"
        runs = [EngineRun(state, ids, params, body.cache_salt,
                          f"{rid}-{i}" if len(inputs) > 1 else rid, COMPLETION_RENAMES,
                          "prompt" if len(inputs) == 1 else f"prompt[{i}]")
                for i, ids in enumerate(inputs)]
        await start_all(request, runs)
        head = {"id": rid, "created": int(time.time()), "model": state.config.served_model_name}
        echo = [p if isinstance(p, str) else state.engine.tokenizer.decode(p) for p in prompts]
        if body.stream:
            return EventStream(_completion_events(state, runs, body, head, inputs, echo))

        async def collect_all() -> list[list[ForkOutput]]:
            return [await run.collect() for run in runs]

        results = await until_disconnect(request, collect_all(), runs)
        tally = UsageTally([len(ids) for ids in inputs])
        choices = []
        for p, forks in enumerate(results):
            for fork in forks:
                tally.add_fork(p, fork)
                text = fork.full_text
                logprobs = None
                if params.logprobs is not None:
                    logprobs, _ = completion_logprobs(state.token_text, fork_entries(
                        state, fork, text, params.skip_special_tokens))
                choices.append({
                    "index": p * params.n + fork.index,
                    "text": echo[p] + text if body.echo else text,
                    "logprobs": logprobs,
                    "finish_reason": fork.finish_reason,
                })
        return JSONResponse({**head, "object": "text_completion", "choices": choices,
                             "usage": tally.doc(), "system_fingerprint": None},
                            headers=server_timing([f for forks in results for f in forks]))

    return r


async def _framed(preamble: list[dict], choices: AsyncIterator[dict], body: Any,
                  chunk_head: dict, tally: UsageTally) -> AsyncIterator[bytes]:
    """One stream's SSE frames: the preamble choices, each choice event (with running usage when
    asked), then the final usage event when asked and [DONE]. An engine failure mid-stream
    becomes a single error event, so the client learns why the stream ended."""
    for choice in preamble:
        yield sse({**chunk_head, "choices": [choice]})
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    try:
        async for choice in choices:
            event = {**chunk_head, "choices": [choice]}
            if continuous:
                event["usage"] = tally.doc()
            yield sse(event)
    except Exception as exc:
        yield sse(stream_error(exc))
    else:
        if body.include_usage:
            yield sse({**chunk_head, "choices": [], "usage": tally.doc()})
    finally:
        await choices.aclose()  # a client gone mid-stream aborts the engine request now
    yield DONE


def _chat_events(state: WorkerState, run: EngineRun, body: ChatCompletionRequest,
                 head: dict, prompt_len: int, tools: ToolUse) -> AsyncIterator[bytes]:
    chunk_head = {**head, "object": "chat.completion.chunk", "system_fingerprint": None}
    want_logprobs = body.logprobs_k is not None
    tally = UsageTally([prompt_len])
    preamble = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(body.n)]

    parsers = {i: tools.stream() for i in range(body.n)}
    covers = {i: TextCover(state.token_text) for i in range(body.n)}

    async def choices() -> AsyncIterator[dict]:
        async for chunk in run:
            tally.add(0, chunk)
            entries = (chunk_entries(state, covers[chunk.index], chunk, chunk.text,
                                     chunk.finished, body.skip_special_tokens)
                       if want_logprobs else [])
            if not (chunk.text or chunk.finished or entries):
                continue   # text held back (a possible stop string or an unfinished character)
            parser = parsers.get(chunk.index)
            if parser is None:
                deltas = [{"content": chunk.text}] if chunk.text else []
            else:   # tool calls: the parser decides what of the text is content or a call
                deltas = parser.feed(chunk.text) if chunk.text else []
                if chunk.finished:
                    deltas += parser.finish()
            logprobs = chat_logprobs(state.token_text, entries) if want_logprobs else None
            for i, delta in enumerate(deltas[:-1]):
                yield {"index": chunk.index, "delta": delta,
                       "logprobs": logprobs if i == 0 else None, "finish_reason": None}
            if not (deltas or chunk.finished or (logprobs and logprobs["content"])):
                continue   # (a skipped special token: no text, no entry)
            yield {
                "index": chunk.index,
                "delta": deltas[-1] if deltas else {},
                "logprobs": logprobs if len(deltas) <= 1 else None,
                "finish_reason": (stream_finish_reason(parser, chunk.finish_reason)
                                  if chunk.finished else None),
            }

    return _framed(preamble, choices(), body, chunk_head, tally)


def _completion_events(state: WorkerState, runs: list[EngineRun], body: CompletionRequest,
                       head: dict, inputs: list[list[int]],
                       echo: list[str]) -> AsyncIterator[bytes]:
    chunk_head = {**head, "object": "text_completion"}
    want_logprobs = body.logprobs is not None
    tally = UsageTally([len(ids) for ids in inputs])
    n = body.n
    preamble = [{"index": p * n + i, "text": text, "logprobs": None, "finish_reason": None}
                for p, text in enumerate(echo) for i in range(n)] if body.echo else []

    async def choices() -> AsyncIterator[dict]:
        offsets: dict[int, TextOffset] = {}
        covers: dict[int, TextCover] = {}
        async for p, chunk in merge_streams(runs):
            tally.add(p, chunk)
            index = p * n + chunk.index
            entries = (chunk_entries(state, covers.setdefault(index, TextCover(state.token_text)),
                                     chunk, chunk.text, chunk.finished, body.skip_special_tokens)
                       if want_logprobs else [])
            if not (chunk.text or chunk.finished or entries):
                continue   # text held back (a possible stop string or an unfinished character)
            logprobs = None
            if want_logprobs:
                logprobs, offsets[index] = completion_logprobs(state.token_text, entries,
                                                               offsets.get(index))
            yield {"index": index, "text": chunk.text, "logprobs": logprobs,
                   "finish_reason": chunk.finish_reason if chunk.finished else None}

    return _framed(preamble, choices(), body, chunk_head, tally)
