"""One chat request's tools, from the validated body to the response: what the template renders,
the constraint the engine decodes under, and the OpenAI `tool_calls` shape of the answer, whole
or as stream deltas."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

from radixpool.tokenization import template_tools
from radixpool.worker.server.tool_format import ToolFormat
from radixpool.worker.server.tool_parsers import (
    ArgumentsPiece,
    CallStart,
    Content,
    ToolCallParser,
    ToolEvent,
    parse_tool_calls,
)
from radixpool.worker.server.tools import checked_tool_choice, tool_grammar


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
        raises 400 naming the field. No grammar yet (`with_grammar`): the prompt is checked
        against the context first, so tools too large for it never reach the compiler."""
        choice = checked_tool_choice(body, messages)
        if choice is None:
            return cls(None, frozenset(), None, None, fmt)
        return cls(choice, frozenset(t.function.name for t in body.tools),
                   template_tools([t.model_dump() for t in body.tools]), None, fmt)

    async def with_grammar(self, body: Any) -> ToolUse:
        """This tool use with the EBNF its calls must match, built off the event loop: the first
        one imports xgrammar (seconds: it brings torch) into this process, later ones take
        milliseconds a tool, and a repeated tool list is a cache hit."""
        if not self.calls_possible:
            return self
        parallel = body.parallel_tool_calls is not False
        grammar = await asyncio.to_thread(tool_grammar, body.tools, self.choice, parallel,
                                          self.format)
        return replace(self, grammar=grammar)

    @property
    def calls_possible(self) -> bool:
        return self.choice not in (None, "none")

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message and finish reason of a whole completion."""
        if not self.calls_possible:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = parse_tool_calls(self.format, self.names, text)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        finished = any(call.finished for call in calls)   # as `stream_finish_reason` says
        return ({"role": "assistant", "content": content,
                 "tool_calls": [call.openai() for call in calls]},
                "tool_calls" if finish_reason == "stop" and finished else finish_reason)

    def stream(self) -> ToolCallStream | None:
        if not self.calls_possible:
            return None
        return ToolCallStream(ToolCallParser(self.format, self.names))


class ToolCallStream:
    """One streamed choice's text → OpenAI chat deltas: `{"content": ...}`, or `{"tool_calls":
    [...]}` with a call's index, id, type and name first, then pieces of its arguments. Adjacent
    deltas of the same kind are merged."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser

    @property
    def calls(self) -> int:
        return self.parser.calls

    def feed(self, text: str) -> list[dict[str, Any]]:
        return _deltas(self.parser.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return _deltas(self.parser.finish())


def _deltas(events: list[ToolEvent]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for event in events:
        last = out[-1] if out else {}
        if isinstance(event, Content):
            if "content" in last:
                last["content"] += event.text
            else:
                out.append({"content": event.text})
        elif isinstance(event, CallStart):
            out.append({"tool_calls": [{"index": event.index, "id": event.id,
                                        "type": "function",
                                        "function": {"name": event.name, "arguments": ""}}]})
        elif isinstance(event, ArgumentsPiece):
            call = last.get("tool_calls", [{}])[0]
            if call.get("index") == event.index and "id" not in call:
                call["function"]["arguments"] += event.text
            else:
                out.append({"tool_calls": [{"index": event.index,
                                            "function": {"arguments": event.text}}]})
        # CallCut: a streamed call's pieces are out already; nothing to take back
    return out


def stream_finish_reason(parser: ToolCallStream | None, finish_reason: str | None) -> str | None:
    if parser is not None and parser.calls and finish_reason == "stop":
        return "tool_calls"
    return finish_reason
