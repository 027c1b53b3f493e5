"""Refusals a request body's own validation makes, so a big body is refused where it is parsed.

A body over `fast_path.INLINE_BODY_BYTES` is validated in a child process, and what the child
returns is unpickled on the event loop's side with the GIL held: two million one-id prompts came
back as two million lists, and every stream on the worker stood still for two seconds, only for
the handler to refuse the batch (`too_many_choices`). The body models make that refusal
themselves, in the handler's order and with its exact error, so such a body comes back as an
error of a few hundred bytes. The same goes for a chat whose messages' text alone is too long for
the context (65k short messages held the loop 0.2 s). What a refusal needs from the worker (its
model names and sizes) reaches the validators as pydantic's validation context, a `Served`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixpool.tokenization import RENDERER_VARIABLES
from radixpool.worker.server.errors import APIError, bad_request

# Completions one request may ask for (prompts × n): each is an engine request, so a few hundred
# bytes of JSON could otherwise queue minutes of work ahead of every other client.
MAX_CHOICES = 1024


def check_choices(total: int, param: str) -> None:
    if total > MAX_CHOICES:
        raise bad_request(f"the request asks for {total} completions (prompts × n); this worker "
                          f"takes at most {MAX_CHOICES} per request", param=param,
                          code="too_many_choices")


# Variables one request may give its chat template (`chat_template_kwargs`): templates read a
# handful, and each is a keyword of the render call (131k of them held the event loop 0.15 s).
MAX_TEMPLATE_KWARGS = 64


def template_kwarg_chars(kwargs: dict[str, Any]) -> dict[str, int]:
    """Each `chat_template_kwargs` value's length in characters as a template prints it (a
    string as itself, anything else as JSON), counted where the body is validated so a large
    document is measured off the event loop; the prompt's length check adds them. Refuses too
    many variables, and names the renderer gives the template itself."""
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise bad_request(f"chat_template_kwargs has {len(kwargs)} keys; this worker takes at "
                          f"most {MAX_TEMPLATE_KWARGS}", param="chat_template_kwargs",
                          code="too_many_template_kwargs")
    for key in kwargs:
        if key in RENDERER_VARIABLES:
            source = "the tools field" if key == "tools" else "the worker"
            raise bad_request(f"chat_template_kwargs may not set '{key}': the chat template "
                              f"gets it from {source}", param=f"chat_template_kwargs.{key}",
                              code="reserved_template_variable")
    return {key: len(value) if isinstance(value, str)
            else len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
            for key, value in kwargs.items()}


def message_chars(messages: list[dict[str, Any]]) -> int:
    """What a chat's messages bring to its prompt's length: their contents' characters."""
    return sum(len(str(m.get("content", ""))) for m in messages)


def chat_prompt_field(messages: list[dict[str, Any]], kwarg_chars: dict[str, int]) -> str:
    """The field a chat prompt too long for the context is refused by: `messages`, unless a
    `chat_template_kwargs` value brings more of its characters."""
    if not kwarg_chars:
        return "messages"
    largest = max(kwarg_chars, key=kwarg_chars.__getitem__)
    if kwarg_chars[largest] > message_chars(messages):
        return f"chat_template_kwargs.{largest}"
    return "messages"


@dataclass(frozen=True)
class Served:
    """What this worker checks a request against (its model names, and its model's sizes once
    loaded); a body model's validation context."""

    model_name: str
    model_path: str
    vocab_size: int | None = None
    context_length: int | None = None
    text_chars: int | None = None   # the most characters a prompt's text may have
    sampling_defaults: dict[str, Any] = field(default_factory=dict)   # generation_config.json's

    def check_model(self, model: str | None) -> None:
        if model is None or model in (self.model_name, self.model_path):
            return
        raise APIError(404, f"the model '{model}' does not exist on this worker; it serves "
                            f"'{self.model_name}'", param="model", code="model_not_found")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.vocab_size
        if ids and max(ids) >= vocab:   # max() runs in C; find the culprit only on failure
            bad = next(t for t in ids if t >= vocab)
            raise bad_request(f"token id {bad} is outside the vocabulary (size {vocab})",
                              param=param)

    def check_text_length(self, chars: int, param: str) -> None:
        if chars > self.text_chars:
            raise bad_request(
                f"the prompt is {chars} characters, too long for this model's context length of "
                f"{self.context_length} tokens (at most {self.text_chars} characters)",
                param=param, code="context_length_exceeded")

    def token_budget(self, prompt_len: int, requested: int | None, prompt_param: str,
                     max_param: str) -> int:
        """Tokens a request may generate; rejects prompts that leave no room."""
        context = self.context_length
        if prompt_len == 0:
            raise bad_request("the prompt is empty", param=prompt_param)
        if prompt_len >= context:
            raise bad_request(
                f"the prompt is {prompt_len} tokens, but this model's context length is "
                f"{context} tokens (prompt plus at least one generated token)",
                param=prompt_param, code="context_length_exceeded")
        room = context - prompt_len
        if requested is None:
            return room
        if requested > room:
            raise bad_request(
                f"{max_param}={requested} plus the prompt's {prompt_len} tokens exceeds this "
                f"model's context length of {context} tokens; ask for at most {room}",
                param=max_param, code="context_length_exceeded")
        return requested


def served(context: Any) -> Served | None:
    """The `Served` a validation ran with, None when it ran without one."""
    return context if isinstance(context, Served) else None
