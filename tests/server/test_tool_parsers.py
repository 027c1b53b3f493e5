"""Tool-call parsing of whole replies (Hermes blocks, Llama 3 JSON, Mistral `[TOOL_CALLS]`), the
tool grammar, and tool validation: pure functions. The streamed parse is in test_tool_stream.py."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from radixpool.worker.server.errors import APIError
from radixpool.worker.server.tool_parsers import parse_tool_calls
from radixpool.worker.server.tools import (
    Tool,
    check_tool_messages,
    resolve_choice,
    tool_grammar,
)

NAMES = {"get_weather", "add"}
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": "}\\n"}}}\n'
             '</tool_call>')


def test_hermes_calls_keep_the_models_argument_text():
    content, calls = parse_tool_calls("hermes", NAMES, TWO_CALLS)
    assert content is None
    assert [c.name for c in calls] == ["get_weather", "add"]
    assert calls[0].arguments == '{"city": "Paris"}'
    assert calls[1].arguments == '{"a": 1, "b": {"c": "}\\n"}}'
    assert json.loads(calls[1].arguments) == {"a": 1, "b": {"c": "}\n"}}
    doc = calls[0].openai()
    assert doc["id"].startswith("call_") and doc["type"] == "function"
    assert calls[0].id != calls[1].id


def test_hermes_text_around_calls_and_bad_blocks_stay_text():
    content, calls = parse_tool_calls("hermes", NAMES,
                                      "Let me check.\n" + TWO_CALLS[:80] + "\nDone. ")
    assert content == "Let me check.\nDone." and len(calls) == 1   # spaces next to calls go
    for text in ("no calls here", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
                 "<tool_call>{not json}</tool_call>", "<tool_call>", " <tool_call>\n{\"na",
                 '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'):
        assert parse_tool_calls("hermes", NAMES, text) == (text, [])


def test_a_call_cut_off_keeps_its_arguments_so_far_and_earlier_calls_stand():
    # As its stream sends it (and as OpenAI answers a call cut by max_tokens): it was left in
    # the content, so the streamed and whole replies differed.
    cut = TWO_CALLS[:-30]
    content, calls = parse_tool_calls("hermes", NAMES, cut)
    assert [(c.name, c.finished) for c in calls] == [("get_weather", True), ("add", False)]
    assert content is None and calls[1].arguments == '{"a": 1, "b'
    only = TWO_CALLS[:40]
    content, calls = parse_tool_calls("hermes", NAMES, only)
    assert content is None and [(c.name, c.arguments, c.finished) for c in calls] == [
        ("get_weather", "", False)]   # cut before its arguments: the stream sent its name
    assert parse_tool_calls("hermes", NAMES, TWO_CALLS[:20]) == (TWO_CALLS[:20], [])  # no name


def test_llama3_and_mistral_formats():
    content, calls = parse_tool_calls(
        "llama3", NAMES, '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
                         '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("add", '{"a": 1}'), ("get_weather", '{"city": "Oslo"}')]
    for text in ("plain answer", '{"name": "nope", "parameters": {}}',
                 'text first {"name": "add", "parameters": {"a": 1}}'):
        assert parse_tool_calls("llama3", NAMES, text) == (text, [])
    content, calls = parse_tool_calls("llama3", NAMES, '{"name": "add", "par')   # cut off
    assert content is None and [(c.name, c.finished) for c in calls] == [("add", False)]
    content, calls = parse_tool_calls(
        "mistral", NAMES, 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 2}}]')
    assert content == "Sure." and calls[0].name == "add" and calls[0].arguments == '{"a": 2}'
    for text in ("no marker", "[TOOL_CALLS][{", '[TOOL_CALLS][{"name": "x", "arguments": {}}]',
                 '[TOOL_CALLS] {"name": "add", "arguments": {}}'):
        assert parse_tool_calls("mistral", NAMES, text) == (text, [])


def test_arguments_are_the_models_own_text():
    """Not re-serialised: escapes and number spellings stay, so the next turn renders the call
    back byte for byte (and re-hits the cache)."""
    args = '{"city": "Z\\u00fcrich", "n": 1.50, "q": "a\\/b"}'
    for fmt, text in [("hermes", f'<tool_call>\n{{"name": "add", "arguments": {args}}}\n'
                                 "</tool_call>"),
                      ("llama3", f'{{"name": "add", "parameters": {args}}}'),
                      ("mistral", f'[TOOL_CALLS][{{"name": "add", "arguments": {args}}}]')]:
        assert parse_tool_calls(fmt, NAMES, text)[1][0].arguments == args


def _tools(*schemas: dict) -> list[Tool]:
    return [Tool.model_validate({"type": "function", "function": {"name": f"f{i}",
                                                                   "parameters": s}})
            for i, s in enumerate(schemas)]


def test_tool_grammar_accepts_calls_in_the_template_format_only():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tools = _tools(schema, {"type": "object", "properties": {}})
    one = '<tool_call>\n{"name": "f0", "arguments": {"n": 3}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "f1", "arguments": {}}\n</tool_call>'
    accept = xgr.testing._is_grammar_accept_string
    required = xgr.Grammar.from_ebnf(tool_grammar(tools, "required", True))
    assert accept(required, one) and accept(required, two)
    assert not accept(required, "hello")
    assert not accept(required, one.replace("3", '"x"'))          # arguments follow the schema
    single = xgr.Grammar.from_ebnf(tool_grammar(tools, "required", False))
    assert accept(single, one) and not accept(single, two)
    named = xgr.Grammar.from_ebnf(tool_grammar(tools, "f1", True))
    assert not accept(named, one) and accept(named, two[len(one) + 1:])
    auto = xgr.Grammar.from_ebnf(tool_grammar(tools, "auto", True))
    assert accept(auto, "just text") and accept(auto, "text then " + one)
    assert not accept(auto, '<tool_call>\n{"name": "f9", "arguments": {}}\n</tool_call>')
    assert tool_grammar(tools, "none", True) is None


def test_tool_validation_names_the_field():
    tools = _tools({"type": "object"})
    for choice, param in [("sometimes", "tool_choice"),
                          ({"type": "function", "function": {"name": "zz"}},
                           "tool_choice.function.name"),
                          ({"type": "function"}, "tool_choice")]:
        with pytest.raises(APIError) as err:
            resolve_choice(tools, choice)
        assert err.value.param == param
    with pytest.raises(APIError) as err:
        resolve_choice(None, "required")
    assert err.value.param == "tool_choice"
    with pytest.raises(APIError) as err:
        resolve_choice(tools + tools, "auto")
    assert err.value.param == "tools[1].function.name"
    assert resolve_choice(tools, {"type": "function", "function": {"name": "f0"}}) == "f0"
    assert resolve_choice(tools, None) == "auto" and resolve_choice(None, None) is None
    call = {"id": "call_1", "type": "function", "function": {"name": "f0", "arguments": "{}"}}
    ok = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
    check_tool_messages(ok)
    for messages, param in [(ok[:1] + ok[2:], "messages[1].tool_call_id"),
                            (ok[:2] + [{"role": "tool", "content": "4"}],
                             "messages[2].tool_call_id"),
                            ([{"role": "assistant", "tool_calls": [
                                {**call, "function": {"name": "f0", "arguments": "{x"}}]}],
                             "messages[0].tool_calls[0].function.arguments")]:
        with pytest.raises(APIError) as err:
            check_tool_messages(messages)
        assert err.value.param == param
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        _tools({"type": "object", "properties": {"a": {"type": "nonsense"}}})
    with pytest.raises(ValueError, match="must be 'object'"):
        _tools({"type": "string"})


def test_a_duplicate_tool_name_is_refused_with_its_code_and_place():
    tools = _tools({"type": "object"}, {"type": "object"}, {"type": "object"})
    tools[2] = Tool.model_validate({"type": "function", "function": {"name": "f0"}})
    with pytest.raises(APIError) as err:
        resolve_choice(tools, "auto")
    assert err.value.status == 400 and err.value.code == "duplicate_tool_name"
    assert err.value.param == "tools[2].function.name" and "tools[0]" in err.value.message


def test_an_unknown_meta_schema_is_checked_as_the_latest_draft_not_fetched():
    unknown = "http://127.0.0.1:9/not-a-meta-schema"
    assert _tools({"$schema": unknown, "type": "object"})
    with pytest.raises(ValueError, match=r"not a valid JSON schema.*at type"):
        _tools({"$schema": unknown, "type": "objec"})
    with pytest.raises(ValueError, match="at properties/a/minimum"):
        _tools({"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
                "properties": {"a": {"minimum": "x"}}})
