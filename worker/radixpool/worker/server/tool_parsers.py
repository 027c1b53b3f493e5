"""Tool calls out of model output, incrementally: one parser for the three call formats, fed the
text as it is generated, answering with events. The non-streamed response runs the same parser
over the whole text, so streamed and non-streamed answers agree by construction.

    Hermes   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   anywhere in the text
    Llama 3  {"name": "f", "parameters": {...}}; {...}   only when the reply starts with it
             (after an optional <|python_tag|>)
    Mistral  [TOOL_CALLS][{"name": "f", "arguments": {...}}, {...}]   after optional text

Events: `Content` for text that can no longer be part of a call's syntax (a possible start of
it, such as a trailing `<tool_` or `[TOOL_CALL`, is held until decided); `CallStart` as soon as
a call's name is complete and names a listed function; then `ArgumentsPiece`s whose
concatenation is the model's own arguments text, exactly (what the template renders back into
the next turn); `CallCut` when the output ends (or goes off the format) inside a call. Whitespace
right before a call, and at the end of a reply that has calls, is not content. A call whose name
is not a listed function, or whose syntax breaks before its name is complete, is text. Calls are
read in the form the tool grammar writes them (name before arguments), which is the only form
the model can write when calls are possible.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from radixpool.worker.server.tool_format import LLAMA3_TAG, MISTRAL_MARKER, ToolFormat
from radixpool.worker.server.tools import CALL_CLOSE, CALL_OPEN


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    index: int
    text: str


@dataclass(frozen=True)
class CallCut:
    """Call `index` never finished; `text` is all the model wrote of it. `ended`: the output
    ended inside it (max_tokens, a stop string), rather than going off the call syntax."""
    index: int
    text: str
    ended: bool = False


ToolEvent = Content | CallStart | ArgumentsPiece | CallCut


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str    # JSON text, as the model wrote it
    id: str
    finished: bool = True   # False: cut off (max_tokens, a stop string): its arguments so far

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_NAME = object()   # a JSON string: the function's name
_WHITESPACE = " \t\r\n"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_OPEN_STRING = re.compile(r'"(?:[^"\\]|\\.)*\\?')
_NAME_HEAD = ("{", '"name"', ":", _NAME)
_ARGS_KEYS = {"hermes": ('"arguments"',), "mistral": ('"arguments"',),
              "llama3": ('"parameters"', '"arguments"')}


def _match(text: str, parts: tuple[Any, ...]) -> tuple[str, int, str | None]:
    """Matches `parts` (literals, tuples of alternative literals, or `_NAME`), whitespace
    allowed before each, at the start of `text`: ("yes", end, name), ("more", 0, None) when
    `text` is a prefix of a match, else ("no", 0, None)."""
    pos, name = 0, None
    for part in parts:
        while pos < len(text) and text[pos] in _WHITESPACE:
            pos += 1
        if pos == len(text):
            return "more", 0, None
        if part is _NAME:
            found = _STRING.match(text, pos)
            if found is None:
                return ("more" if _OPEN_STRING.fullmatch(text, pos) else "no"), 0, None
            try:
                name = json.loads(found.group())
            except ValueError:
                return "no", 0, None
            pos = found.end()
            continue
        options = part if isinstance(part, tuple) else (part,)
        hit = next((lit for lit in options if text.startswith(lit, pos)), None)
        if hit is None:
            rest = text[pos:]
            return ("more" if any(lit.startswith(rest) for lit in options) else "no"), 0, None
        pos += len(hit)
    return "yes", pos, name


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _ContentGate:
    """Content goes out as it comes except trailing whitespace, held until text follows (sent)
    or a call does (dropped); at the end it is sent only if the reply has no calls."""

    def __init__(self) -> None:
        self.held = ""

    def add(self, text: str) -> str:
        body = text.rstrip()
        if not body:
            self.held += text
            return ""
        out, self.held = self.held + body, text[len(body):]
        return out

    def drop(self) -> None:
        self.held = ""

    def finish(self, calls: bool) -> str:
        out, self.held = ("" if calls else self.held), ""
        return out


class ToolCallParser:
    """Model output in format `fmt` → events; `names` are the callable functions. `feed` takes
    the next piece of text, `finish` ends the output; `calls` counts the finished calls."""

    def __init__(self, fmt: ToolFormat, names: set[str] | frozenset[str]) -> None:
        self.fmt = fmt
        self.names = names
        self.state = "text"   # text | head | keys | arguments | close | passthrough
        self.buffer = ""      # undecided text
        self.pending = ""     # syntax consumed before the head, text again if the call fails
        self.raw = ""         # the current call as written, for CallCut
        self.head: tuple[Any, ...] = _NAME_HEAD
        self.started = 0      # calls announced (the next call's index)
        self.calls = 0        # calls whose arguments are complete
        self.depth = 0        # the arguments' brace depth; a string's state below
        self.in_string = False
        self.escaped = False
        self.gate = _ContentGate()

    def feed(self, text: str) -> list[ToolEvent]:
        self.buffer += text
        out: list[ToolEvent] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        rest, self.buffer = self.buffer, ""
        if self.state in ("keys", "arguments"):
            out.append(CallCut(self.started - 1, self.raw + rest, ended=True))
        elif self.state in ("text", "passthrough", "head"):
            self._content(self.pending + rest, out)
        self.pending, self.state = "", "passthrough"
        self._emit(self.gate.finish(self.calls > 0), out)
        return out

    def _emit(self, text: str, out: list[ToolEvent]) -> None:
        if text:
            out.append(Content(text))

    def _content(self, text: str, out: list[ToolEvent]) -> None:
        self._emit(self.gate.add(text), out)

    def _step(self, out: list[ToolEvent]) -> bool:
        """Consumes what the current state can decide; False when it needs more text."""
        return getattr(self, f"_{self.state}")(out)

    def _text(self, out: list[ToolEvent]) -> bool:
        if self.fmt == "llama3":
            return self._llama3_start(out)
        opener = CALL_OPEN if self.fmt == "hermes" else MISTRAL_MARKER
        at = self.buffer.find(opener)
        if at < 0:
            cut = len(self.buffer) - _held(self.buffer, opener)
            self._content(self.buffer[:cut], out)
            self.buffer = self.buffer[cut:]
            return False
        self._content(self.buffer[:at], out)
        self.pending, self.buffer = opener, self.buffer[at + len(opener):]
        self.head = ("[", *_NAME_HEAD) if self.fmt == "mistral" else _NAME_HEAD
        self.state = "head"
        return True

    def _llama3_start(self, out: list[ToolEvent]) -> bool:
        body = self.buffer.lstrip(_WHITESPACE)
        if not body or (LLAMA3_TAG.startswith(body) and body != LLAMA3_TAG):
            return False
        lead = len(self.buffer) - len(body)
        if body.startswith(LLAMA3_TAG):
            lead += len(LLAMA3_TAG)
        elif not body.startswith("{"):
            self.state = "passthrough"
            return True
        self.pending, self.buffer = self.buffer[:lead], self.buffer[lead:]
        self.head, self.state = _NAME_HEAD, "head"
        return True

    def _passthrough(self, out: list[ToolEvent]) -> bool:
        self._content(self.buffer, out)
        self.buffer = ""
        return False

    def _head(self, out: list[ToolEvent]) -> bool:
        verdict, end, name = _match(self.buffer, self.head)
        if verdict == "more":
            return False
        if verdict == "no" or name not in self.names:   # not a call: its text is content
            self._content(self.pending, out)
            self.pending = ""
            self.state = "passthrough" if self.fmt == "llama3" else "text"
            return True
        self.gate.drop()
        out.append(CallStart(self.started, new_call_id(), name))
        self.started += 1
        self.raw, self.pending = self.pending + self.buffer[:end], ""
        self.buffer, self.state = self.buffer[end:], "keys"
        return True

    def _keys(self, out: list[ToolEvent]) -> bool:
        verdict, end, _ = _match(self.buffer, (",", _ARGS_KEYS[self.fmt], ":", "{"))
        if verdict == "more":
            return False
        if verdict == "no":
            out.append(CallCut(self.started - 1, self.raw))
            self.state = "passthrough" if self.fmt == "llama3" else "text"
            return True
        self.raw += self.buffer[:end - 1]
        self.buffer = self.buffer[end - 1:]   # from the arguments' opening brace
        self.depth, self.in_string, self.escaped = 0, False, False
        self.state = "arguments"
        return True

    def _arguments(self, out: list[ToolEvent]) -> bool:
        end = self._arguments_end(self.buffer)
        piece = self.buffer if end is None else self.buffer[:end]
        if piece:
            out.append(ArgumentsPiece(self.started - 1, piece))
            self.raw += piece
        self.buffer = "" if end is None else self.buffer[end:]
        if end is None:
            return False
        self.calls += 1
        self.state = "close"
        return True

    def _arguments_end(self, text: str) -> int | None:
        """Where the arguments object closes in `text` (just past its brace), carrying the
        brace depth and string state across pieces."""
        for i, ch in enumerate(text):
            if self.escaped:
                self.escaped = False
            elif self.in_string:
                if ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch == "{":
                self.depth += 1
            elif ch == "}":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None

    def _close(self, out: list[ToolEvent]) -> bool:
        """After a call's arguments: its closing syntax, then the next call or text."""
        if self.fmt == "hermes":
            verdict, end, _ = _match(self.buffer, ("}", CALL_CLOSE))
            if verdict == "more":
                return False
            self.buffer = self.buffer[end:]
            self.state = "text"
            return True
        verdict, end, _ = _match(self.buffer, ("}",))
        if verdict == "more":
            return False
        rest = self.buffer[end:]
        body = rest.lstrip(" \t\r\n;" if self.fmt == "llama3" else _WHITESPACE)
        if verdict == "yes" and not body:
            return False
        if verdict == "yes" and body[0] == ("{" if self.fmt == "llama3" else ","):
            lead = len(rest) - len(body) + (self.fmt == "mistral")
            self.pending, self.buffer = rest[:lead], rest[lead:]
            self.head, self.state = _NAME_HEAD, "head"
            return True
        # Mistral's `]` ends the calls; anything else off the format is text again
        ends = verdict == "yes" and self.fmt == "mistral" and body[0] == "]"
        self.buffer = body[1:] if ends else self.buffer[end:]
        self.state = "passthrough" if self.fmt == "llama3" else "text"
        return True


def parse_tool_calls(fmt: ToolFormat, names: set[str] | frozenset[str],
                     text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole reply → (content, calls), as its stream gives them: a call the output ended in
    (`finished` False) keeps the arguments written so far, as its stream sent them; one that
    went off the call syntax is content as the model wrote it; a reply with no call is all
    content, verbatim."""
    parser = ToolCallParser(fmt, names)
    content, calls = "", {}
    for event in parser.feed(text) + parser.finish():
        if isinstance(event, Content):
            content += event.text
        elif isinstance(event, CallStart):
            calls[event.index] = ToolCall(event.name, "", event.id)
        elif isinstance(event, ArgumentsPiece):
            call = calls[event.index]
            calls[event.index] = ToolCall(call.name, call.arguments + event.text, call.id)
        elif event.ended:   # the stream sent its start and pieces, and takes nothing back
            call = calls[event.index]
            calls[event.index] = ToolCall(call.name, call.arguments, call.id, finished=False)
        else:
            del calls[event.index]
            content += event.text
    if not calls:
        return text, []
    return content or None, [calls[i] for i in sorted(calls)]
