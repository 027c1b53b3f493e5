"""OpenAI tools on chat completions: the request's tools, its tool choice, and the grammar that
makes the model's calls well-formed.

Calls are written in the served model's own format (`tool_format.py`): Hermes/Qwen blocks,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Llama 3.x bare `{"name": ..., "parameters": {...}}` objects, or Mistral's `[TOOL_CALLS][...]`
array. The tiny models' own chat template teaches the Hermes one.

`"required"` and a named function constrain the whole output to such blocks (one block when
`parallel_tool_calls` is false); `"auto"` lets the model write text, and constrains a call's
name and arguments from the moment it opens a call. The constraint is an xgrammar
structural tag, converted to EBNF here so the engine takes it like any `ebnf` constraint. The
arguments follow the tool's JSON schema with the engine's fixed separators and no free
whitespace, so what the model emits is exactly what the template renders back into the history
of the next turn (agent loops re-hit the radix cache).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from radixpool.worker.grammar.json_schema import json_schema_ebnf
from radixpool.worker.server.errors import bad_request
from radixpool.worker.server.tool_format import MISTRAL_MARKER, ToolFormat

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
CALL_SEPARATOR = "\n"
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "
_XGRAMMAR_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# the drafts jsonschema-rs knows without fetching them
META_SCHEMAS = frozenset(f"{uri}{end}" for end in ("", "#") for uri in (
    "http://json-schema.org/draft-04/schema", "http://json-schema.org/draft-06/schema",
    "http://json-schema.org/draft-07/schema", "http://json-schema.org/schema",
    "https://json-schema.org/draft/2019-09/schema",
    "https://json-schema.org/draft/2020-12/schema"))


def call_prefix(name: str) -> str:
    """What a call to `name` starts with, up to its arguments."""
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": '


CALL_SUFFIX = "}\n" + CALL_CLOSE


def check_schema(schema: dict[str, Any]) -> None:
    """Raises ValueError naming where `schema` breaks its draft's meta-schema. jsonschema-rs
    checks 50,000 properties in about 20 ms; the Python `jsonschema` took 0.6 ms a property
    (128 tools of 400 properties held a body-validating child for 20-30 s). A `$schema` other
    than a known draft is checked as the latest draft, as `jsonschema` did: never fetched."""
    import jsonschema_rs

    if isinstance(schema.get("$schema"), str) and schema["$schema"] not in META_SCHEMAS:
        schema = {k: v for k, v in schema.items() if k != "$schema"}
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as exc:
        where = "/".join(str(p) for p in exc.instance_path)
        raise ValueError(f"not a valid JSON schema: {exc.message}"
                         + (f" (at {where})" if where else "")) from None
    except Exception as exc:   # jsonschema-rs's ReferencingError and the like
        raise ValueError(f"not a valid JSON schema: {_first_line(exc)}") from None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _a_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        check_schema(value)
        if value.get("type", "object") != "object":
            raise ValueError("the arguments of a function are a JSON object: the schema's type "
                             f"must be 'object', got {value.get('type')!r}")
        return value

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


ToolChoiceMode = Literal["none", "auto", "required"]


def resolve_choice(tools: list[Tool] | None, choice: Any) -> str | None:
    """The request's tool choice as "none", "auto", "required" or the forced function's name;
    None when the request has no tools. Raises 400 naming `tool_choice` or `tools`."""
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools: the request lists none",
                              param="tool_choice")
        return None
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise bad_request(f"function name {name!r} is also tools[{seen[name]}]; names must "
                              "be unique", param=f"tools[{i}].function.name",
                              code="duplicate_tool_name")
        seen[name] = i
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice in ("none", "auto", "required"):
            return choice
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or "
                          f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}",
                          param="tool_choice")
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
    if not isinstance(name, str):
        raise bad_request("a named tool_choice is {'type': 'function', 'function': "
                          "{'name': ...}}", param="tool_choice")
    if name not in seen:
        raise bad_request(f"tool_choice names function {name!r}, which is not among the tools "
                          f"({', '.join(seen)})", param="tool_choice.function.name")
    return name


def checked_tool_choice(body: Any, messages: list[dict[str, Any]]) -> str | None:
    """A chat request's tool choice (`resolve_choice`) once its tool history, its tools and
    their combination with other output constraints are checked. Raises 400 naming the field."""
    check_tool_messages(messages)
    choice = resolve_choice(body.tools, body.tool_choice)
    if choice not in (None, "none"):
        for field in ("response_format", "regex", "ebnf"):
            if getattr(body, field) is not None and \
                    not (field == "response_format" and body.response_format.type == "text"):
                raise bad_request(f"{field} cannot be combined with tools unless "
                                  "tool_choice is 'none'", param=field)
    return choice


def check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """Every `tool` message answers a call an earlier assistant message made, and every
    assistant call is well-formed. Raises 400 naming the message's field."""
    open_calls: set[str] = set()
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            calls = message.get("tool_calls") or []
            if not isinstance(calls, list):
                raise bad_request("tool_calls must be an array", param=f"messages[{i}].tool_calls")
            for j, call in enumerate(calls):
                _check_call(call, f"messages[{i}].tool_calls[{j}]")
                open_calls.add(call["id"])
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad_request("a tool message needs the tool_call_id of the call it answers",
                                  param=f"messages[{i}].tool_call_id")
            if call_id not in open_calls:
                raise bad_request(f"tool_call_id {call_id!r} matches no tool call of an earlier "
                                  "assistant message", param=f"messages[{i}].tool_call_id")


def _check_call(call: Any, where: str) -> None:
    if not isinstance(call, dict) or not isinstance(call.get("id"), str):
        raise bad_request("a tool call is {'id', 'type': 'function', 'function': {'name', "
                          "'arguments'}}", param=where)
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request("a tool call's function needs a name", param=f"{where}.function")
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        raise bad_request("arguments must be a JSON string", param=f"{where}.function.arguments")
    try:
        json.loads(arguments)
    except ValueError:
        raise bad_request("arguments is not valid JSON",
                          param=f"{where}.function.arguments") from None


def tool_grammar(tools: list[Tool], choice: str, parallel: bool,
                 fmt: ToolFormat = "hermes") -> str | None:
    """The EBNF constraint for `choice` (None for "none") in the model's call format `fmt`.
    Raises 400 naming the tool whose schema the grammar compiler cannot take."""
    if choice == "none":
        return None
    if choice not in ("auto", "required"):
        tools = [t for t in tools if t.function.name == choice]
    key = json.dumps([[t.function.name, t.function.schema] for t in tools])
    try:
        return _grammar(key, choice if choice in ("auto", "required") else "named", parallel,
                        fmt)
    except ValueError:
        pass
    for i, tool in enumerate(tools):   # find the culprit for the error message
        try:
            _grammar(json.dumps([[tool.function.name, tool.function.schema]]), "named", False)
        except ValueError as exc:
            raise bad_request(f"the grammar compiler cannot take this schema: {exc}",
                              param=f"tools[{i}].function.parameters") from None
    raise bad_request("the tools' schemas do not compile together", param="tools")


@lru_cache(maxsize=256)
def _grammar(key: str, mode: str, parallel: bool, call_format: ToolFormat = "hermes") -> str:
    import xgrammar as xgr

    fmt = _structure(json.loads(key), mode, parallel, call_format)
    try:
        grammar = xgr.Grammar.from_structural_tag(
            json.dumps({"type": "structural_tag", "format": fmt}))
    except Exception as exc:   # xgrammar raises RuntimeError / its own error types
        raise ValueError(_first_line(exc)) from None
    return str(grammar)


# Per format: a call's text up to its arguments, what closes it, what separates parallel calls,
# and the text that starts a call in "auto" output.
_SYNTAX = {
    "hermes": (call_prefix, CALL_SUFFIX, CALL_SEPARATOR, CALL_OPEN),
    "llama3": (lambda name: f'{{"name": {json.dumps(name)}, "parameters": ', "}", "; ",
               '{"name": '),
    "mistral": (lambda name: f'{{"name": {json.dumps(name)}, "arguments": ', "}", ", ",
                MISTRAL_MARKER),
}


def _structure(tools: list[list[Any]], mode: str, parallel: bool,
               call_format: ToolFormat) -> dict[str, Any]:
    """The structural tag of `mode` ("named", "required" or "auto"). Mistral wraps the calls in
    one `[TOOL_CALLS][...]` array; the others write the calls one after another."""
    prefix, suffix, separator, trigger = _SYNTAX[call_format]
    tags = [{"type": "tag", "begin": prefix(name),
             "content": {"type": "grammar", "grammar": _schema_ebnf(json.dumps(schema))},
             "end": suffix}
            for name, schema in tools]
    calls: dict[str, Any] = tags[0] if mode == "named" else {
        "type": "tags_with_separator", "tags": tags, "separator": separator,
        "at_least_one": True, "stop_after_first": not parallel}
    if call_format == "mistral":
        calls = {"type": "tag", "begin": MISTRAL_MARKER + "[", "content": calls, "end": "]"}
        if mode == "auto":
            return {"type": "triggered_tags", "triggers": [trigger], "tags": [calls],
                    "at_least_one": False, "stop_after_first": True}
        return calls
    if mode == "auto":
        return {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
                "at_least_one": False, "stop_after_first": not parallel}
    return calls


@lru_cache(maxsize=256)
def _schema_ebnf(schema: str) -> str:
    try:
        return json_schema_ebnf(schema)
    except Exception as exc:
        raise ValueError(_first_line(exc)) from None


def _first_line(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return _XGRAMMAR_NOISE.sub("", lines[0]) if lines else type(exc).__name__
