"""One chat request's tools, from the validated body to the response: what the template renders,
the constraint the engine decodes under, and the OpenAI `tool_calls` shape of the answer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from radixpool.tokenization import template_tools
from radixpool.worker.server.errors import bad_request
from radixpool.worker.server.tool_format import ToolFormat
from radixpool.worker.server.tool_parsers import PARSERS, HermesStream, WholeCallStream
from radixpool.worker.server.tools import check_tool_messages, resolve_choice, tool_grammar


@dataclass(frozen=True)
class ToolUse:
    choice: str | None                 # None: no tools; else "none", "auto", "required" or a name
    names: frozenset[str]
    rendered: list[dict[str, Any]] | None    # the tools as the chat template gets them
    grammar: str | None                # EBNF the output must match
    format: ToolFormat = "hermes"      # the served model's call syntax

    @classmethod
    async def of(cls, body: Any, messages: list[dict[str, Any]],
                 fmt: ToolFormat = "hermes") -> ToolUse:
        """Validates the request's tools against each other, its tool choice and its history;
        raises 400 naming the field. The grammar is built off the event loop: the first one
        imports xgrammar (seconds: it brings torch) into this process, later ones take
        milliseconds, and a repeated tool list is a cache hit."""
        check_tool_messages(messages)
        choice = resolve_choice(body.tools, body.tool_choice)
        if choice is None:
            return cls(None, frozenset(), None, None, fmt)
        if choice != "none":
            for field in ("response_format", "regex", "ebnf"):
                if getattr(body, field) is not None and \
                        not (field == "response_format" and body.response_format.type == "text"):
                    raise bad_request(f"{field} cannot be combined with tools unless "
                                      "tool_choice is 'none'", param=field)
        if body.chat_template_kwargs and "tools" in body.chat_template_kwargs:
            raise bad_request("chat_template_kwargs may not set 'tools'; use the tools field",
                              param="chat_template_kwargs.tools")
        parallel = body.parallel_tool_calls is not False
        grammar = await asyncio.to_thread(tool_grammar, body.tools, choice, parallel, fmt)
        return cls(choice, frozenset(t.function.name for t in body.tools),
                   template_tools([t.model_dump() for t in body.tools]), grammar, fmt)

    @property
    def calls_possible(self) -> bool:
        return self.choice not in (None, "none")

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message and finish reason of a whole completion."""
        if not self.calls_possible:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = PARSERS[self.format](text, set(self.names))
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return ({"role": "assistant", "content": content,
                 "tool_calls": [call.openai() for call in calls]},
                "tool_calls" if finish_reason == "stop" else finish_reason)

    def stream(self) -> HermesStream | WholeCallStream | None:
        if not self.calls_possible:
            return None
        if self.format == "hermes":
            return HermesStream()
        return WholeCallStream(self.format, set(self.names))


def stream_finish_reason(parser: HermesStream | WholeCallStream | None,
                         finish_reason: str | None) -> str | None:
    if parser is not None and parser.calls and finish_reason == "stop":
        return "tool_calls"
    return finish_reason
