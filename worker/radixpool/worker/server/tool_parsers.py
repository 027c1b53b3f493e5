"""Tool calls out of model output: pure functions, text in, (content, calls) out.

`parse_hermes` reads the `<tool_call>` blocks Hermes/Qwen models (and the tiny models) write;
`parse_llama3` the bare `{"name": ..., "parameters": ...}` objects of Llama 3.x;
`parse_mistral` the `[TOOL_CALLS][...]` array of Mistral. A block that is not a well-formed call
of a known function stays in the text: the client sees what the model said rather than a call
it cannot run. `HermesStream` does the Hermes parse incrementally for streamed responses: text
as soon as it cannot be the start of a block, then per call its name first and its arguments in
pieces; `WholeCallStream` streams the other formats' text and gives their calls whole at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from radixpool.worker.server.tool_format import LLAMA3_TAG, MISTRAL_MARKER
from radixpool.worker.server.tools import CALL_CLOSE, CALL_OPEN, CALL_SUFFIX

_HERMES_BLOCK = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE),
                           re.DOTALL)
_CALL_HEAD = re.compile(r'\s*\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str    # JSON text, as the model wrote it
    id: str = ""

    def openai(self) -> dict[str, Any]:
        return {"id": self.id or new_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_call(doc: Any, names: set[str], args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(doc, dict) or doc.get("name") not in names:
        return None
    arguments = doc.get(args_key, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(doc["name"], json.dumps(arguments, ensure_ascii=False))


def _same_json(text: str, value: Any) -> bool:
    try:
        return json.loads(text) == value
    except ValueError:
        return False


def _content(text: str) -> str | None:
    text = text.strip()
    return text or None


def parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES_BLOCK.finditer(text):
        call = None
        body = match.group(1)
        head = _CALL_HEAD.match(body)
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        if doc is not None:
            call = _as_call(doc, names)
            own = body[head.end():-1].strip() if head is not None else ""
            if call is not None and _same_json(own, doc.get("arguments")):
                call = ToolCall(call.name, own)   # the model's own text: what the next turn renders
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    return (_content("".join(kept)) if calls else text), calls


def parse_llama3(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """`{"name": "f", "parameters": {...}}`, several separated by `;`, maybe after
    `<|python_tag|>`; anything else is text."""
    body = text.strip().removeprefix(LLAMA3_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(body):
        try:
            doc, end = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _as_call(doc, names, "parameters" if "parameters" in doc else "arguments")
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \n;":
            pos += 1
    return None, calls


def parse_mistral(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """`[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` after optional text."""
    at = text.find(MISTRAL_MARKER)
    if at < 0:
        return text, []
    try:
        docs, _ = json.JSONDecoder().raw_decode(text[at + len(MISTRAL_MARKER):].lstrip())
    except ValueError:
        return text, []
    docs = docs if isinstance(docs, list) else [docs]
    calls = [_as_call(doc, names) for doc in docs]
    if not calls or None in calls:
        return text, []
    return _content(text[:at]), calls   # type: ignore[return-value]


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesStream:
    """Streamed Hermes output → OpenAI deltas. Feed text pieces; each feed returns the deltas
    that are certain by now: `{"content": ...}` or `{"tool_calls": [...]}`. Assumes calls in
    the constrained form (the grammar's `<tool_call>\\n{"name": "...", "arguments": ` head);
    `finish()` returns what is left."""

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False
        self.calls = 0
        self.head_done = False
        self.text_out = False

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.buffer += piece
        out: list[dict[str, Any]] = []
        while True:
            if not self.in_call:
                at = self.buffer.find(CALL_OPEN)
                cut = at if at >= 0 else len(self.buffer) - _held(self.buffer, CALL_OPEN)
                text = self.buffer[:cut]
                if self.calls:
                    text = text.lstrip("\n")   # the separator between calls
                if text:
                    out.append({"content": text})
                    self.text_out = True
                self.buffer = self.buffer[cut:] if at < 0 else self.buffer[at + len(CALL_OPEN):]
                if at < 0:
                    return out
                self.in_call, self.head_done = True, False
            if not self.head_done:
                head = _CALL_HEAD.match(self.buffer)
                if head is None:
                    return out
                name = json.loads(head.group(1))
                out.append({"tool_calls": [{"index": self.calls, "id": new_call_id(),
                                            "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
                self.buffer = self.buffer[head.end():]
                self.head_done = True
            end = self.buffer.find(CALL_SUFFIX)
            cut = end if end >= 0 else len(self.buffer) - _held(self.buffer, CALL_SUFFIX)
            if cut > 0:
                out.append({"tool_calls": [{"index": self.calls,
                                            "function": {"arguments": self.buffer[:cut]}}]})
            self.buffer = self.buffer[cut:]
            if end < 0:
                return out
            self.buffer = self.buffer[len(CALL_SUFFIX):]
            self.in_call = False
            self.calls += 1

    def finish(self) -> list[dict[str, Any]]:
        """The held-back tail (an unfinished call's arguments stay with that call)."""
        rest, self.buffer = self.buffer, ""
        if not rest:
            return []
        if self.in_call and self.head_done:
            return [{"tool_calls": [{"index": self.calls, "function": {"arguments": rest}}]}]
        if self.in_call:
            rest = CALL_OPEN + rest
        return [{"content": rest}]


PARSERS = {"hermes": parse_hermes, "llama3": parse_llama3, "mistral": parse_mistral}


class WholeCallStream:
    """Streamed Llama 3 or Mistral output → OpenAI deltas. Text passes through as content while
    it cannot be part of a call; from where a call may start (Llama 3: the output opens with `{`
    or `<|python_tag|>`; Mistral: `[TOOL_CALLS]`) the rest is held and parsed whole by
    `finish()`, which gives each call in one delta, or the held text as content if it holds no
    well-formed call."""

    def __init__(self, fmt: str, names: set[str]) -> None:
        self.fmt = fmt
        self.names = names
        self.buffer = ""
        self.holding = False
        self.passing = False   # Llama 3: the output opened with text, so it holds no call
        self.calls = 0

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.buffer += piece
        if self.holding:
            return []
        if self.fmt == "llama3":
            return self._feed_llama3()
        at = self.buffer.find(MISTRAL_MARKER)
        cut = at if at >= 0 else len(self.buffer) - _held(self.buffer, MISTRAL_MARKER)
        text, self.buffer = self.buffer[:cut], self.buffer[cut:]
        self.holding = at >= 0
        return [{"content": text}] if text else []

    def _feed_llama3(self) -> list[dict[str, Any]]:
        if not self.passing:
            head = self.buffer.lstrip()
            if not head or LLAMA3_TAG.startswith(head):
                return []
            if head.startswith(("{", LLAMA3_TAG)):
                self.holding = True
                return []
            self.passing = True
        text, self.buffer = self.buffer, ""
        return [{"content": text}]

    def finish(self) -> list[dict[str, Any]]:
        rest, self.buffer = self.buffer, ""
        if not rest:
            return []
        content, calls = PARSERS[self.fmt](rest, self.names) if self.holding else (rest, [])
        out: list[dict[str, Any]] = [{"content": content}] if content else []
        for call in calls:
            out.append({"tool_calls": [{"index": self.calls, "id": new_call_id(),
                                        "type": "function",
                                        "function": {"name": call.name,
                                                     "arguments": call.arguments}}]})
            self.calls += 1
        return out
