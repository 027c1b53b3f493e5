"""Refusals a request body's own validation makes, so a big body is refused where it is parsed.

A body over `fast_path.INLINE_BODY_BYTES` is validated in a child process, and what the child
returns is unpickled on the event loop's side with the GIL held: two million one-id prompts came
back as two million lists, and every stream on the worker stood still for two seconds, only for
the handler to refuse the batch (`too_many_choices`). The body models make that refusal
themselves, in the handler's order and with its exact error, so such a body comes back as an
error of a few hundred bytes. What a refusal needs from the worker (its model names) reaches the
validators as pydantic's validation context, a `Served`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixpool.worker.server.errors import APIError, bad_request

# Completions one request may ask for (prompts × n): each is an engine request, so a few hundred
# bytes of JSON could otherwise queue minutes of work ahead of every other client.
MAX_CHOICES = 1024


def check_choices(total: int, param: str) -> None:
    if total > MAX_CHOICES:
        raise bad_request(f"the request asks for {total} completions (prompts × n); this worker "
                          f"takes at most {MAX_CHOICES} per request", param=param,
                          code="too_many_choices")


@dataclass(frozen=True)
class Served:
    """The names this worker answers to; a body model's validation context."""

    model_name: str
    model_path: str

    def check_model(self, model: str | None) -> None:
        if model is None or model in (self.model_name, self.model_path):
            return
        raise APIError(404, f"the model '{model}' does not exist on this worker; it serves "
                            f"'{self.model_name}'", param="model", code="model_not_found")


def served(context: Any) -> Served | None:
    """The `Served` a validation ran with, None when it ran without one."""
    return context if isinstance(context, Served) else None
