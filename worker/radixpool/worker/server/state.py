"""What every route shares: the config, the engine once it is loaded, lifecycle and metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from radixpool.child_pool import ChildPool
from radixpool.protocol.errors import NONFINITE_LOGITS
from radixpool.worker.engine_errors import RequestFault
from radixpool.worker.messages import EngineStats
from radixpool.worker.server.config import ServerConfig
from radixpool.worker.server.errors import bad_request
from radixpool.worker.server.fast_path import BODY_MEMORY_BYTES, BODY_MODULES, BODY_PROCESSES
from radixpool.worker.server.lifecycle import Lifecycle
from radixpool.worker.server.logprobs import TokenText
from radixpool.worker.server.metrics import WorkerMetrics
from radixpool.worker.server.nonfinite_watch import (
    PROBE_OUTPUT_TOKENS,
    NonfiniteWatch,
    probe_prompt,
)
from radixpool.worker.server.request_checks import Served, message_chars
from radixpool.worker.server.tool_format import ToolFormat, resolve_tool_format

# Prompts longer than this (characters) are tokenized off the event loop.
INLINE_TOKENIZE_CHARS = 8192
# Chats of more messages are rendered off the event loop, however short their text: the template
# prints each one's role and markers (65k empty messages rendered in place held the loop 1.2 s).
INLINE_CHAT_MESSAGES = 256
# Text over context × longest token × this many characters cannot fit the context, whatever it
# tokenizes to (the margin is for normalizers that drop characters): refused before tokenizing,
# which takes ~250 bytes a character (16 MiB of text took the worker from 0.25 to 4.3 GiB).
TEXT_LENGTH_MARGIN = 4
PROBE_TIMEOUT_S = 30.0   # the model's self-check (it waits its turn in the batch like any)


def radixpool_version() -> str:
    from radixpool.cli import version

    return version()


@dataclass
class WorkerState:
    config: ServerConfig
    version: str = field(default_factory=radixpool_version)
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    engine: Any = None
    token_text: TokenText | None = None
    tool_format: ToolFormat = "hermes"   # the model's tool-call syntax, set when it loads
    started_at: int = field(default_factory=lambda: int(time.time()))
    # engine requests not yet closed, by rid: a finished request's rid may be taken again before
    # its run closes, so a rid may have two holders
    active_rids: Counter[str] = field(default_factory=Counter)
    # where large bodies are validated (fast_path.py), started on the first
    bodies: ChildPool = field(
        default_factory=lambda: ChildPool(BODY_PROCESSES, BODY_MEMORY_BYTES, BODY_MODULES))
    metrics: WorkerMetrics = field(init=False)
    nonfinite_watch: NonfiniteWatch = field(init=False)

    def __post_init__(self) -> None:
        self.nonfinite_watch = NonfiniteWatch(self.config.unhealthy_after_nonfinite,
                                              self.probe_model)
        self.metrics = WorkerMetrics(self.config.served_model_name, self.version,
                                     lambda: self.engine, self.engine_stats,
                                     lambda: self.nonfinite_watch.broken)

    def attach(self, engine: Any) -> None:
        self.engine = engine
        self.token_text = TokenText(engine.tokenizer)
        tokenizer = engine.tokenizer   # a chat with tools renders through its tool_use template
        template = (getattr(tokenizer, "tool_use_template", None)
                    or getattr(tokenizer, "chat_template", None))
        self.tool_format = resolve_tool_format(self.config.tool_call_format, template)
        self.lifecycle.mark_ready()

    async def probe_model(self) -> bool:
        """The model's self-check (`nonfinite_watch`): are its logits finite for a fixed,
        harmless prompt? Raises when it cannot tell."""
        info = self.engine.info
        prompt = probe_prompt(info.vocab_size, info.context_length)   # a tiny context fits it
        outputs = max(1, min(PROBE_OUTPUT_TOKENS, info.context_length - len(prompt)))
        try:
            await asyncio.wait_for(self.engine.generate_async(
                input_ids=prompt, sampling_params={"max_new_tokens": outputs, "temperature": 0,
                                                   "ignore_eos": True}), PROBE_TIMEOUT_S)
        except RequestFault as exc:
            if exc.code != NONFINITE_LOGITS:
                raise
            return False
        return True

    def engine_stats(self) -> EngineStats | None:
        """The engine's latest stats (the core reports them after every step, with every abort
        or refusal, and when it goes idle)."""
        return self.engine.stats() if self.engine is not None else None

    def core_failure(self) -> str:
        """Why the engine is unusable (its core process died, or it never started)."""
        return self.lifecycle.failure or "the engine core process died"

    def abort_all(self) -> int:
        """Abort every running request: streams end with finish_reason "abort", whole answers
        with a 503 `draining` once `lifecycle.drain_expired` is set (`EngineRun.collect`)."""
        rids = list(self.active_rids)
        for rid in rids:
            self.engine.abort(rid)
        return len(rids)

    @property
    def context_length(self) -> int:
        return self.engine.info.context_length

    @property
    def vocab_size(self) -> int:
        return self.engine.info.vocab_size

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        return self.engine.info.sampling_defaults

    @property
    def served(self) -> Served:
        if self.engine is None:
            return Served(self.config.served_model_name, self.config.engine.model_path)
        info = self.engine.info
        return Served(self.config.served_model_name, self.config.engine.model_path,
                      info.vocab_size, info.context_length,
                      info.context_length * self.engine.tokenizer.longest_token_chars
                      * TEXT_LENGTH_MARGIN, info.sampling_defaults)

    def check_model(self, model: str | None) -> None:
        self.served.check_model(model)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        self.served.check_token_ids(ids, param)

    def token_budget(self, prompt_len: int, requested: int | None, prompt_param: str,
                     max_param: str) -> int:
        """Tokens this request may generate; rejects prompts that leave no room."""
        return self.served.token_budget(prompt_len, requested, prompt_param, max_param)

    def check_text_length(self, chars: int, param: str) -> None:
        self.served.check_text_length(chars, param)

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        self.check_text_length(len(text), param)
        tokenizer = self.engine.tokenizer
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return tokenizer.encode(text, add_special_tokens)
        return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          template_kwargs: dict | None = None,
                          kwarg_chars: dict[str, int] | None = None) -> list[int]:
        """The rendered, tokenized chat prompt. `template_kwargs` are the request's validated
        `chat_template_kwargs` (and the tools as the template gets them), `kwarg_chars` their
        lengths as validation measured them: everything the template may print counts toward
        the prompt's length, is refused naming its field before rendering when the context
        cannot hold it, and is rendered off the event loop when long."""
        from radixpool.tokenization import ChatTemplateError

        tokenizer = self.engine.tokenizer
        kwargs = dict(template_kwargs or {})
        size = message_chars(messages)
        self.check_text_length(size, "messages")
        if kwargs.get("tools"):   # rendered as JSON: at least this many characters
            size += len(json.dumps(kwargs["tools"], separators=(",", ":")))
            self.check_text_length(size, "tools")
        if kwarg_chars:
            size += sum(kwarg_chars.values())
            largest = max(kwarg_chars, key=kwarg_chars.__getitem__)
            self.check_text_length(size, f"chat_template_kwargs.{largest}")
        try:
            if size <= INLINE_TOKENIZE_CHARS and len(messages) <= INLINE_CHAT_MESSAGES:
                return tokenizer.encode_chat(messages, add_generation_prompt, **kwargs)
            return await asyncio.to_thread(tokenizer.encode_chat, messages,
                                           add_generation_prompt, **kwargs)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from None
        except (TypeError, ValueError) as exc:   # the template tripped over a message's shape
            raise bad_request(f"the chat template could not render the messages: {exc}",
                              param="messages") from None
