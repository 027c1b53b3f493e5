"""Native endpoints: `/generate`, health, `/flush_cache`, `/server_info`, `/tokenizer`, `/load`,
`/prefix_probe` (see docs/worker.md and docs/protocol.md for the shapes)."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError, from_json
from starlette.responses import JSONResponse

from radixpool.protocol.errors import NONFINITE_LOGITS
from radixpool.protocol.server_info import ServerInfo
from radixpool.worker.engine_errors import EngineBusy
from radixpool.worker.sampling_params import CONSTRAINT_FIELDS, SamplingParams
from radixpool.worker.server import request_checks
from radixpool.worker.server.errors import (
    APIError,
    bad_request,
    error_body,
    stream_error,
    unavailable,
)
from radixpool.worker.server.generation import (
    EngineRun,
    ForkOutput,
    build_params,
    merge_streams,
    server_timing,
    start_all,
    until_disconnect,
)
from radixpool.worker.server.lifecycle import Phase
from radixpool.worker.server.logprobs import finite_logprob
from radixpool.worker.server.openai_protocol import ChatMessage, Texts, TokenIdLists, TokenIds
from radixpool.worker.server.request_checks import Served, check_choices
from radixpool.worker.server.sse import DONE, EventStream, sse
from radixpool.worker.server.state import WorkerState

HEALTH_GENERATE_TIMEOUT_S = 30.0


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | Texts | None = None
    input_ids: TokenIds | TokenIdLists | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: StrictBool = False
    rid: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    cache_salt: Annotated[str, Field(max_length=256)] | None = None

    @model_validator(mode="after")
    def _one_prompt_the_worker_takes(self, info: ValidationInfo) -> GenerateBody:
        """Also the handler's refusals of a request for its size, made here in its order
        (`request_checks`): an empty batch, more prompts than completions a request may ask
        for, sampling params that do not match the prompts, and, when validation runs for a
        loaded worker, each token-id prompt's own refusals."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' or 'input_ids'")
        prompts, batch = self.prompts()
        field = "text" if self.text is not None else "input_ids"
        if not prompts:
            raise bad_request("the batch is empty", param=field)
        check_choices(len(prompts), field)
        docs = self.params_docs(len(prompts))
        served = request_checks.served(info.context)
        if self.input_ids is None or served is None or served.vocab_size is None:
            return self
        choices = 0
        for i, (ids, doc) in enumerate(zip(prompts, docs, strict=True)):
            where = f"[{i}]" if batch else ""
            served.check_token_ids(ids, f"input_ids{where}")
            _, _, choices = self.checked_prompt(served, where, f"input_ids{where}", ids, doc,
                                                choices)
        return self

    def params_docs(self, count: int) -> list[dict[str, Any]]:
        """Each prompt's sampling params; refuses a list that does not match the prompts."""
        docs = self.sampling_params
        if not isinstance(docs, list):
            return [docs or {}] * count
        if len(docs) != count:
            raise bad_request(f"sampling_params has {len(docs)} entries for {count} prompts",
                              param="sampling_params")
        return docs

    def checked_prompt(self, served: Served, where: str, prompt_param: str, ids: list[int],
                       doc: dict[str, Any], choices: int) -> tuple[SamplingParams, str, int]:
        """A prompt's sampling params, their path prefix, and the choices asked for so far
        with them; refuses what does not fit. Its ids are checked by the caller."""
        sp_prefix = f"sampling_params{where if isinstance(self.sampling_params, list) else ''}."
        p = build_params(doc, served.vocab_size, {}, sp_prefix, served.sampling_defaults)
        choices += p.n
        check_choices(choices, f"{sp_prefix}n")
        # a max_new_tokens given must fit; the default (128, or the model's) is cut to the room
        # the context leaves, as the scheduler ends a request at the context
        served.token_budget(len(ids), p.max_new_tokens if "max_new_tokens" in doc else None,
                            prompt_param, f"{sp_prefix}max_new_tokens")
        return p, sp_prefix, choices

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """The prompts, and whether the request was a batch."""
        if self.text is not None:
            return ([self.text], False) if isinstance(self.text, str) else (list(self.text), True)
        ids = self.input_ids
        if ids and isinstance(ids[0], list):
            return list(ids), True
        return [list(ids)], False


class ProbeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_ids: TokenIds | None = None
    text: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    cache_salt: Annotated[str, Field(max_length=256)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _json_whatever_its_content_type(cls, value: Any) -> Any:
        # FastAPI hands over the raw bytes of a body not labelled JSON (`curl -d` labels it a
        # form); the generation routes read any body as JSON, with pydantic's parser (its depth
        # limit included), and so does this one
        if not isinstance(value, bytes):
            return value
        try:
            return from_json(value)
        except ValueError as exc:
            raise PydanticCustomError("json_invalid", "{error}", {"error": str(exc)}) from None

    @model_validator(mode="after")
    def _one_prompt(self) -> ProbeBody:
        given = [self.input_ids is not None, self.text is not None, self.messages is not None]
        if sum(given) != 1:
            raise ValueError("give exactly one of 'input_ids', 'text' or 'messages'")
        return self


def _meta(fork: ForkOutput | Any, rid: str, logprobs: bool) -> dict:
    meta = {
        "id": rid,
        "prompt_tokens": fork.prompt_tokens,
        "completion_tokens": fork.completion_tokens,
        "cached_tokens": fork.cached_tokens,
        "finish_reason": fork.finish_reason,
        "matched_stop": fork.matched_stop,
    }
    if logprobs:
        meta["logprobs"] = [finite_logprob(lp) for lp in fork.logprobs or ()]
        meta["top_logprobs"] = [[[token, finite_logprob(lp)] for token, lp in alts]
                                for alts in fork.top_logprobs or ()]
    return meta


def router(state: WorkerState) -> APIRouter:
    r = APIRouter()

    @r.post("/generate")
    async def generate(body: GenerateBody, request: Request):
        # a batch that is empty, too big or unmatched by its sampling params failed validation
        prompts, batch = body.prompts()
        served = state.served
        inputs, params, prefixes, prompt_params = [], [], [], []
        choices = 0
        for i, (prompt, doc) in enumerate(zip(prompts, body.params_docs(len(prompts)),
                                              strict=True)):
            where = f"[{i}]" if batch else ""
            if isinstance(prompt, str):
                prompt_param = f"text{where}"
                ids = await state.encode(prompt, prompt_param)
            else:
                ids = prompt
                prompt_param = f"input_ids{where}"
                state.check_token_ids(ids, prompt_param)
            p, sp_prefix, choices = body.checked_prompt(served, where, prompt_param, ids, doc,
                                                        choices)
            inputs.append(ids)
            params.append(p)
            prefixes.append(sp_prefix)
            prompt_params.append(prompt_param)
        rid = body.rid or uuid.uuid4().hex
        rids = [f"{rid}-{i}" if batch else rid for i in range(len(inputs))]
        # a constraint the engine cannot compile is reported under its sampling_params path
        runs = [EngineRun(state, ids, p, body.cache_salt, rids[i],
                          {name: prefixes[i] + name for name in CONSTRAINT_FIELDS},
                          prompt_params[i])
                for i, (ids, p) in enumerate(zip(inputs, params, strict=True))]
        await start_all(request, runs)
        if body.stream:
            return EventStream(_generate_events(runs, params, _choice_ids(rid, batch, params)))

        async def collect_all() -> list[list[ForkOutput]]:
            return [await run.collect() for run in runs]

        results = await until_disconnect(request, collect_all(), runs)
        ids = _choice_ids(rid, batch, params)
        first = _first_choices(params)
        out = [
            {"text": fork.full_text, "output_ids": fork.token_ids,
             "meta_info": _meta(fork, ids[first[i] + fork.index],
                                params[i].logprobs is not None)}
            for i, forks in enumerate(results) for fork in forks
        ]
        return JSONResponse(out if batch or len(out) > 1 else out[0],
                            headers=server_timing([f for forks in results for f in forks]))

    @r.get("/health")
    async def health() -> JSONResponse:
        lifecycle = state.lifecycle
        if lifecycle.serving and state.nonfinite_watch.broken:
            return JSONResponse({"status": "failed", "code": NONFINITE_LOGITS,
                                 "message": state.nonfinite_watch.reason}, status_code=503)
        if lifecycle.serving and state.engine.alive:
            return JSONResponse({"status": "ok"})
        if lifecycle.serving or lifecycle.phase is Phase.FAILED:
            return JSONResponse({"status": "failed", "message": state.core_failure()},
                                status_code=503)
        return JSONResponse({"status": lifecycle.phase.value,
                             "message": lifecycle.unavailable_reason()}, status_code=503,
                            headers={"Retry-After": "5"})

    @r.get("/livez")
    async def livez() -> JSONResponse:
        """Liveness: fails only once the engine is gone for good (loading and draining are
        alive), so an orchestrator restarts a worker whose core died, or whose model gives
        nothing but non-finite logits (`nonfinite_watch`)."""
        if state.nonfinite_watch.broken:
            return JSONResponse({"status": "dead", "code": NONFINITE_LOGITS,
                                 "message": state.nonfinite_watch.reason}, status_code=503)
        if state.lifecycle.phase is not Phase.FAILED and (state.engine is None
                                                          or state.engine.alive):
            return JSONResponse({"status": "alive"})
        return JSONResponse({"status": "dead", "message": state.core_failure()},
                            status_code=503)

    @r.get("/health_generate")
    async def health_generate() -> JSONResponse:
        engine = state.engine
        prompt = [engine.tokenizer.eos_token_id or 0]
        started = time.monotonic()
        try:
            await asyncio.wait_for(engine.generate_async(
                input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0}),
                HEALTH_GENERATE_TIMEOUT_S)
        except Exception as exc:
            return JSONResponse(error_body(f"one-token generation failed: {exc!r}",
                                           "service_unavailable"), status_code=503)
        return JSONResponse({"status": "ok", "seconds": round(time.monotonic() - started, 4)})

    @r.post("/flush_cache")
    async def flush_cache() -> dict:
        try:
            await state.engine.flush_cache_async()
        except EngineBusy as exc:   # refused at once, as SGLang does: a flush never waits
            raise APIError(409, str(exc), code="requests_in_flight") from None
        except RuntimeError as exc:
            raise unavailable(f"cannot flush the cache: {exc}") from None
        return {"instance_id": state.engine.instance_id}

    @r.get("/server_info")
    async def server_info() -> dict:
        info = state.engine.info
        return ServerInfo(
            model=state.config.engine.model_path,
            served_model_name=state.config.served_model_name,
            context_length=info.context_length,
            kv_capacity_tokens=info.kv_capacity_tokens,
            page_size=info.page_size,
            kv_block_size=info.kv_block_size,
            instance_id=state.engine.instance_id,
            version=state.version,
            eviction_policy=state.config.engine.eviction_policy,
            schedule_policy=state.config.engine.schedule_policy,
        ).to_json()

    @r.get("/tokenizer")
    async def tokenizer() -> dict:
        return {"files": state.engine.tokenizer.files}

    @r.get("/load")
    async def load() -> dict:
        stats = state.engine_stats()
        capacity = stats.kv_capacity_tokens if stats else 0
        return {
            "running": stats.running if stats else 0,
            "waiting": stats.waiting if stats else 0,
            "kv_usage": stats.kv_used_tokens / capacity if capacity else 0.0,
            "instance_id": state.engine.instance_id,
        }

    @r.post("/prefix_probe")
    async def prefix_probe(body: ProbeBody) -> dict:
        if body.input_ids is not None:
            ids = body.input_ids
            state.check_token_ids(ids, "input_ids")
        elif body.text is not None:
            ids = await state.encode(body.text, "text")
        else:
            ids = await state.encode_chat([m.template_dict() for m in body.messages])
        # the cache holds no path longer than the context: the rest cannot change the answer,
        # and a prompt of millions of ids is too big a message for the engine core's pipe
        cached = await state.engine.probe_async(ids[:state.context_length], body.cache_salt)
        return {"prompt_tokens": len(ids), "cached_tokens": cached}

    return r


def _first_choices(params: list) -> list[int]:
    """Each prompt's first choice's place in the answer: prompts may ask for different n."""
    return list(itertools.accumulate((p.n for p in params[:-1]), initial=0))


def _choice_ids(rid: str, batch: bool, params: list) -> list[str]:
    """`meta_info.id` of each choice, in answer order: the request's id when it is the only
    choice, else the id and the choice's index (a batch of single choices keeps the prompt's
    engine id, `rid-i`), so every choice of an answer has its own."""
    choices = sum(p.n for p in params)
    return [f"{rid}-{k}" for k in range(choices)] if batch or choices > 1 else [rid]


async def _generate_events(runs: list[EngineRun], params: list, ids: list[str]
                           ) -> AsyncIterator[bytes]:
    # a choice's index is its place in the non-streamed answer
    first = _first_choices(params)
    try:
        async for p, chunk in merge_streams(runs):
            index = first[p] + chunk.index
            event = {
                "index": index,
                "text": chunk.text,
                "output_ids": list(chunk.token_ids),
                "meta_info": _meta(chunk, ids[index], params[p].logprobs is not None),
            }
            if not chunk.finished:
                event["meta_info"]["finish_reason"] = None
            yield sse(event)
    except Exception as exc:
        yield sse(stream_error(exc))
    yield DONE
