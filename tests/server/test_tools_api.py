"""Tools through a real worker with the official `openai` SDK and the tiny random model:
`tool_choice="required"` and a named function always give calls whose arguments validate,
non-streamed and streamed (assembled by the SDK's own stream helper); `"auto"` gives text or
valid calls; a conversation goes on after a `tool` message and re-hits the cache; bad tools,
choices and tool messages are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                          "unit": {"type": "string", "enum": ["c", "f"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "boolean"}}}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                           "parameters": schema}}
         for name, schema in SCHEMAS.items()]
MSG = [{"role": "system", "content": "You are an agent."},
       {"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "add"}}


def _valid(calls, only: str | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert only in (None, call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_forced_calls_validate_every_time(client, choice):
    only = None if choice == "required" else "add"
    for seed in range(4):
        reply = client.chat.completions.create(
            model="tiny", messages=MSG, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed, n=2)
        for c in reply.choices:
            assert c.finish_reason == "tool_calls"
            assert c.message.content is None and len(c.message.tool_calls) == 1
            _valid(c.message.tool_calls, only)
    reply = client.chat.completions.create(   # parallel: one or more calls, each valid
        model="tiny", messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=400,
        temperature=1.0, seed=7)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason in ("tool_calls", "length")
    if reply.choices[0].finish_reason == "length":   # the last call cut off: its part so far
        calls = calls[:-1]
    _valid(calls, only)


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_streamed_calls_assemble_to_the_non_streamed_ones(client, choice):
    kwargs = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice=choice,
                  parallel_tool_calls=False, max_tokens=120, temperature=0)
    reply = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs, stream_options={"include_usage": True}) as s:
        final = s.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    _valid(streamed.message.tool_calls, None if choice == "required" else "add")
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls]
    assert final.usage.completion_tokens == reply.usage.completion_tokens

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    pieces = [d.tool_calls[0] for d in (c.choices[0].delta for c in chunks if c.choices)
              if d.tool_calls]
    assert pieces[0].id and pieces[0].function.name and pieces[0].function.arguments == ""
    assert len(pieces) > 2 and all(p.id is None and p.function.name is None
                                   for p in pieces[1:])   # arguments in pieces after the name


def test_auto_gives_text_or_valid_calls(client):
    seen = set()
    for seed in range(6):
        reply = client.chat.completions.create(
            model="tiny", messages=MSG, tools=TOOLS, tool_choice="auto", max_tokens=60,
            temperature=1.0, seed=seed)
        c = reply.choices[0]
        if c.message.tool_calls:
            _valid(c.message.tool_calls)
            seen.add("calls")
        else:
            assert isinstance(c.message.content, str)
            seen.add("text")
    assert seen   # which of the two the random model picks is up to it


def test_conversation_continues_after_tool_message_and_hits_the_cache(client):
    first = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=120, temperature=0)
    message = first.choices[0].message
    history = MSG + [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                      "content": json.dumps({"temperature": 21})}]
    second = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                            max_tokens=8, temperature=0, tool_choice="none")
    assert second.choices[0].message.tool_calls is None
    assert isinstance(second.choices[0].message.content, str)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    # the call renders back exactly as generated: turn 2 reuses turn 1's prompt and output
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16, (cached, first.usage)


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$schema": 5}}}]},
     "tools[0].function.parameters"),
    # xgrammar kept the pattern alone: a call with {"code": "ABCDEFG"} was let through
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"code": {
            "type": "string", "pattern": "^[A-Z]+$", "maxLength": 4}}, "required": ["code"],
        "additionalProperties": False}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "messages": MSG + [{"role": "tool", "tool_call_id": "call_x",
                                          "content": "1"}]}, "messages[2].tool_call_id"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
]


@pytest.mark.parametrize("kwargs,param", BAD)
def test_bad_tool_input_is_a_400_naming_the_field(client, kwargs, param):
    kwargs = {"messages": MSG, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", max_tokens=5, **kwargs)
    assert info.value.body["param"] == param, info.value.body
    reply = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3)
    assert reply.choices[0].message.content is not None   # still serving


def _accumulate(chunks, index: int = 0) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """A streamed choice put together the way SDK users do by hand (the SDK's `stream()` helper
    refuses `finish_reason: "length"`): content, (name, arguments) per call, finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in (c for c in chunk.choices if c.index == index):
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                name, arguments = calls.get(piece.index, ("", ""))
                calls[piece.index] = (name + (piece.function.name or ""),
                                      arguments + (piece.function.arguments or ""))
            finish = choice.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def test_auto_streamed_equals_non_streamed(client):
    """Whatever "auto" makes of the output (text or calls), streaming says the same."""
    for seed in range(3):
        kwargs = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice="auto",
                      max_tokens=40, temperature=1.0, seed=seed)
        reply = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = _accumulate(client.chat.completions.create(**kwargs,
                                                                            stream=True))
        assert finish == reply.finish_reason
        assert content == reply.message.content
        assert calls == [(c.function.name, c.function.arguments)
                         for c in reply.message.tool_calls or []]


@pytest.mark.parametrize("max_tokens", [30, 45])
def test_a_call_cut_off_by_max_tokens_reads_the_same_streamed_or_not(client, max_tokens):
    """As OpenAI answers it: the call, its name and the arguments written so far, with
    finish_reason "length". The non-streamed reply left it in `content` as raw call syntax,
    while its stream sent it as a call."""
    kwargs = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required",
                  max_tokens=max_tokens, temperature=1.0, seed=3)
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason == "length"
    assert reply.message.content is None and len(reply.message.tool_calls) == 1
    call = reply.message.tool_calls[0]
    assert call.function.name in SCHEMAS and call.id.startswith("call_")
    content, calls, finish = _accumulate(client.chat.completions.create(**kwargs, stream=True))
    assert (content, calls, finish) == (None, [(call.function.name, call.function.arguments)],
                                        "length")


def test_streamed_choices_each_get_their_own_calls(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MSG, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=120, temperature=1.0, seed=11, n=3, stream=True))
    for index in range(3):
        content, calls, finish = _accumulate(chunks, index)
        assert content is None and finish == "tool_calls" and len(calls) == 1
        name, arguments = calls[0]
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
