"""Request models of the OpenAI-compatible endpoints, validated at the HTTP edge.

Ranges live in the field definitions, so a bad value is answered with the OpenAI field name
(`max_tokens`, not the engine's `max_new_tokens`) and the OpenAPI schema documents them. Unknown
fields are rejected like OpenAI does; features this server does not have (audio, ...) are
rejected with a message instead of being silently ignored. Engine-only sampling knobs (`top_k`,
`min_p`, `repetition_penalty`, `ignore_eos`, ...) are accepted as extensions, and `cache_salt`
names the KV cache namespace (see docs/protocol.md). Structured output: `response_format`
(`json_object`, `json_schema`) on both endpoints, and the extensions `regex` and `ebnf`. Tools:
`tools`, `tool_choice`, `parallel_tool_calls` on chat (see tools.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from radixpool.worker.sampling_params import MIN_REPETITION_PENALTY
from radixpool.worker.server import request_checks
from radixpool.worker.server.errors import bad_request
from radixpool.worker.server.request_checks import MAX_CHOICES, check_choices
from radixpool.worker.server.tools import Tool, checked_tool_choice

Seed = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[StrictInt, Field(ge=0)]
# Prompt lists stop at their first bad item (fail_fast): in a union every branch is tried, and a
# 4M-id prompt with one bad id made the token-id-lists branch report 4M errors (31 s, 4.6 GiB).
TokenIds = Annotated[list[TokenId], Field(fail_fast=True)]
TokenIdLists = Annotated[list[TokenIds], Field(fail_fast=True)]
Texts = Annotated[list[str], Field(fail_fast=True)]
Stop = str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] | None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    # OpenAI pads its deltas with an `obfuscation` field unless this is false; no effect here,
    # where deltas carry none
    include_obfuscation: StrictBool | None = None


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """`text`, `json_object` (any JSON object) or `json_schema` (output valid for the schema)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema (with its `schema`) goes with type 'json_schema', "
                             "and only with it")
        return self

    def schema_text(self) -> str | None:
        """The engine's `json_schema`: JSON text, or None for plain text."""
        if self.type == "json_object":
            return JSON_OBJECT_SCHEMA
        if self.json_schema is not None:
            return json.dumps(self.json_schema.schema_)
        return None


JSON_OBJECT_SCHEMA = '{"type": "object"}'


class SamplingFields(BaseModel):
    """Sampling fields shared by chat and completions (OpenAI names, plus extensions)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] = 1
    temperature: Annotated[StrictFloat, Field(ge=0, le=2)] | None = None
    top_p: Annotated[StrictFloat, Field(ge=0, le=1)] | None = None   # 0: the likeliest token
    stop: Stop = None
    seed: Seed | None = None
    frequency_penalty: Annotated[StrictFloat, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[StrictFloat, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, Annotated[StrictFloat, Field(ge=-100, le=100)]] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions (SGLang / vLLM names)
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Annotated[StrictFloat, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[
        StrictFloat, Field(ge=MIN_REPETITION_PENALTY, le=10)] | None = None
    ignore_eos: StrictBool = False
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    cache_salt: Annotated[str, Field(max_length=256)] | None = None
    # structured output: at most one of these
    response_format: ResponseFormat | None = None
    regex: Annotated[str, Field(min_length=1)] | None = None
    ebnf: Annotated[str, Field(min_length=1)] | None = None
    # accepted for SDK compatibility, no effect here
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None

    @field_validator("n", "stream", "logprobs", "echo", mode="before", check_fields=False)
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI's API makes these nullable, and an SDK sends an explicit None as null: null
        means the default."""
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_with_stream(cls, value: StreamOptions | None, info: Any
                                    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):   # as OpenAI answers
            raise ValueError("only allowed when stream is true")
        return value

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _room_for_min_tokens(cls, value: int | None, info: Any) -> int | None:
        """A limit the request sets below its own `min_tokens` contradicts it (a default limit
        only caps `min_tokens`, see `sampling_dict`)."""
        least = info.data.get("min_tokens") or 0
        if value is not None and value < least:
            raise ValueError(f"must be at least min_tokens ({least})")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        return value

    def sampling_dict(self, max_new_tokens: int, logprobs: int | None) -> dict[str, Any]:
        """Engine `SamplingParams` fields; what the request left unset keeps engine defaults."""
        doc: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": min(self.min_tokens, max_new_tokens),
            "n": self.n,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": self.logit_bias,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.include_stop_str_in_output,
            "logprobs": logprobs,
            "json_schema": self.response_format and self.response_format.schema_text(),
            "regex": self.regex,
            "ebnf": self.ebnf,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                     "presence_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                doc[name] = value
        if self.top_p == 0:   # OpenAI takes [0, 1]; the nucleus of mass 0 is the top token
            del doc["top_p"]
            doc["top_k"] = 1
        return doc

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# OpenAI fields that need features this server does not have: rejected, never ignored.
_UNSUPPORTED = {
    "functions": "function calling (the legacy API; use tools)",
    "function_call": "function calling", "audio": "audio output", "modalities": "audio output",
    "prediction": "predicted outputs", "web_search_options": "web search",
    "moderation": "moderation",
    "prompt_cache_options": "cache breakpoints and lifetimes (the radix cache keeps every prefix "
                            "as its eviction policy allows)",
}


def _reject_unsupported(name: str, value: Any) -> None:
    # (["text"] is OpenAI's default: what a text model gives anyway; `web_search_options` {}
    # asks for web search with its defaults, as OpenAI's own example does)
    if value is None or (value in ([], {}) and name != "web_search_options") or \
            (name == "modalities" and value == ["text"]):
        return
    raise ValueError(f"{_UNSUPPORTED[name]} is not supported by this server")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")   # template-specific keys pass through

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, Any]:
        doc = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            doc["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            doc["content"] = ""
        return doc


class ChatCompletionRequest(SamplingFields):
    """`messages` is read as `template_messages`, the chat template's dicts: a request
    validated in a child process (a body over `fast_path.INLINE_BODY_BYTES`) comes back with
    those alone. 65k messages as models took 0.4 s to unpickle on the event loop, with the GIL
    held; as dicts they take 20 ms, but with the handler's checks that followed they still held
    it 0.05-0.2 s, only for the chat to be refused as too long. Messages whose text alone is too
    long for the context are refused where they are validated, after the handler's earlier
    refusals (model, tools) in its order, so such a body comes back as one error."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    parallel_tool_calls: StrictBool | None = None
    # accepted for SDK compatibility, no effect here (prefix reuse needs no cache key: the
    # gateway routes on the prompt itself)
    reasoning_effort: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory"] | None = None   # what KV in memory gives
    safety_identifier: str | None = None
    # extensions
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Any = None   # checked against the tools by tools.resolve_choice
    # rejected when set
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None

    @field_validator("functions", "function_call", "audio", "modalities", "prediction",
                     "web_search_options", "moderation", "prompt_cache_options")
    @classmethod
    def _unsupported(cls, value: Any, info: Any) -> Any:
        _reject_unsupported(info.field_name, value)
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_with_logprobs(cls, value: int | None, info: Any) -> int | None:
        if value is not None and not info.data.get("logprobs"):   # as vLLM answers
            raise ValueError("only allowed when logprobs is true")
        return value

    _template_messages: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _template_kwarg_chars: dict[str, int] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _render_messages(self, info: ValidationInfo) -> ChatCompletionRequest:
        self._template_messages = [m.template_dict() for m in self.messages]
        self._template_kwarg_chars = request_checks.template_kwarg_chars(
            self.chat_template_kwargs or {})
        served = request_checks.served(info.context)
        if served is not None and served.text_chars is not None:
            chars = request_checks.message_chars(self._template_messages)
            if chars > served.text_chars:   # the handler's refusals up to its length check
                served.check_model(self.model)
                checked_tool_choice(self, self._template_messages)
                served.check_text_length(chars, "messages")
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        return {**state, "__dict__": {**state["__dict__"], "messages": []}}

    @property
    def template_messages(self) -> list[dict[str, Any]]:
        return self._template_messages

    @property
    def template_kwarg_chars(self) -> dict[str, int]:
        """`chat_template_kwargs`' lengths, by key (`request_checks.template_kwarg_chars`)."""
        return self._template_kwarg_chars

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = str | Texts | TokenIds | TokenIdLists


class CompletionRequest(SamplingFields):
    prompt: Prompt
    # Unset (or null): OpenAI's default of 16, cut to the room the context leaves; a value given
    # must fit, or the request is refused naming it.
    max_tokens: Annotated[StrictInt, Field(ge=1, description="default 16")] | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: StrictBool = False
    best_of: Annotated[StrictInt, Field(ge=1, le=128)] | None = None
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (insertion) is not supported by this server")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: Any) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(f"best_of must equal n ({n}); ranking completions is not supported")
        return value

    @model_validator(mode="after")
    def _what_the_worker_takes(self, info: ValidationInfo) -> CompletionRequest:
        """The handler's refusals before it tokenizes, made here in its order when validation
        runs for a worker (`request_checks`): an unknown model, an empty batch, more completions
        than a request may ask for, echo with logprobs, and, once the worker's model is
        loaded, each token-id prompt's own refusals."""
        served = request_checks.served(info.context)
        if served is None:
            return self
        served.check_model(self.model)
        prompts = self.prompts()
        if not prompts:
            raise bad_request("prompt must not be an empty list", param="prompt")
        check_choices(len(prompts) * self.n, "n" if len(prompts) <= MAX_CHOICES else "prompt")
        if self.echo and self.logprobs is not None:
            # The echoed prompt would need its own logprobs, which the engine does not compute;
            # completion-only logprobs under an echoed text would be misaligned.
            raise bad_request("echo together with logprobs is not supported: this worker does "
                              "not compute prompt logprobs", param="echo")
        if served.vocab_size is None:
            return self
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                break
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            served.check_token_ids(prompt, param)
            served.token_budget(len(prompt), self.max_tokens, param, "max_tokens")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: each item is a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)
