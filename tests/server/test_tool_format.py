"""The served model's tool-call format: detected from its chat template (or the flag), and then
used end to end: the grammar of "required"/named writes calls in that syntax only, and the
non-streamed and streamed parsers read that syntax back."""

from __future__ import annotations

import pytest
import xgrammar as xgr

from radixpool.cli import build_parser
from radixpool.worker.server.config import config_from_args
from radixpool.worker.server.tool_format import detect_tool_format, resolve_tool_format
from radixpool.worker.server.tool_use import ToolUse
from radixpool.worker.server.tools import Tool, tool_grammar
from radixpool.worker.tiny_model import CHAT_TEMPLATE

# Fragments in the style of the real templates (written here, not copied).
LLAMA31 = ('{%- if tools %}<|start_header_id|>user<|end_header_id|>\n\nAnswer with a JSON '
           'function call: {"name": function name, "parameters": dictionary of argument '
           'name and its value}.{% endif %}{%- if builtin_tools %}<|python_tag|>{% endif %}')
LLAMA32 = ('{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n'
           '{%- if m.tool_calls %}{"name": "{{ c.name }}", "parameters": '
           '{{ c.arguments | tojson }}}{% endif %}{% endfor %}')
MISTRAL = ('{%- for m in messages %}{%- if m.tool_calls %}[TOOL_CALLS][{%- for c in '
           'm.tool_calls %}{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments '
           '}}}{% endfor %}]{% else %}[INST] {{ m.content }} [/INST]{% endif %}{% endfor %}')
QWEN = '{%- if tools %}<tools>{{ tools }}</tools> wrap calls in <tool_call></tool_call>{% endif %}'


@pytest.mark.parametrize("template, expected", [
    (CHAT_TEMPLATE, "hermes"), (QWEN, "hermes"), (LLAMA31, "llama3"), (LLAMA32, "llama3"),
    (MISTRAL, "mistral"), (None, "hermes"), ("", "hermes"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
])
def test_format_is_detected_from_the_chat_template(template, expected):
    assert detect_tool_format(template) == expected


def test_the_flag_overrides_detection_and_is_checked(tmp_path):
    assert resolve_tool_format("auto", MISTRAL) == "mistral"
    assert resolve_tool_format("llama3", MISTRAL) == "llama3"
    assert resolve_tool_format("hermes", LLAMA31) == "hermes"
    (tmp_path / "m").mkdir()
    parse = build_parser().parse_args
    assert config_from_args(parse(["worker", "--model", str(tmp_path / "m")])) \
        .tool_call_format == "auto"
    assert config_from_args(parse(["worker", "--model", str(tmp_path / "m"),
                                   "--tool-call-format", "mistral"])).tool_call_format == "mistral"
    with pytest.raises(SystemExit):
        parse(["worker", "--model", str(tmp_path / "m"), "--tool-call-format", "xml"])


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": f"f{i}",
                                                               "parameters": s}})
         for i, s in enumerate([SCHEMA, {"type": "object", "properties": {}}])]
accept = xgr.testing._is_grammar_accept_string


def _grammar(choice: str, parallel: bool, fmt: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(tool_grammar(TOOLS, choice, parallel, fmt))


def test_llama3_grammar_writes_bare_json_calls():
    one = '{"name": "f0", "parameters": {"n": 3}}'
    two = one + '; {"name": "f1", "parameters": {}}'
    required = _grammar("required", True, "llama3")
    assert accept(required, one) and accept(required, two)
    assert not accept(required, '<tool_call>\n{"name": "f0", "arguments": {"n": 3}}\n</tool_call>')
    assert not accept(required, one.replace("3", '"x"'))       # arguments follow the schema
    assert not accept(required, '{"name": "f0", "arguments": {"n": 3}}')
    single = _grammar("required", False, "llama3")
    assert accept(single, one) and not accept(single, two)
    named = _grammar("f1", True, "llama3")
    assert accept(named, '{"name": "f1", "parameters": {}}') and not accept(named, one)
    auto = _grammar("auto", True, "llama3")
    assert accept(auto, "plain text") and accept(auto, one)
    assert not accept(auto, '{"name": "f9", "parameters": {}}')


def test_mistral_grammar_writes_one_tool_calls_array():
    one = '[TOOL_CALLS][{"name": "f0", "arguments": {"n": 3}}]'
    two = '[TOOL_CALLS][{"name": "f0", "arguments": {"n": 3}}, {"name": "f1", "arguments": {}}]'
    required = _grammar("required", True, "mistral")
    assert accept(required, one) and accept(required, two)
    assert not accept(required, '{"name": "f0", "arguments": {"n": 3}}')
    assert not accept(required, one.replace("3", "true"))
    assert not accept(required, "[TOOL_CALLS][]")
    single = _grammar("required", False, "mistral")
    assert accept(single, one) and not accept(single, two)
    named = _grammar("f1", False, "mistral")
    assert accept(named, '[TOOL_CALLS][{"name": "f1", "arguments": {}}]')
    assert not accept(named, one)
    auto = _grammar("auto", True, "mistral")
    assert accept(auto, "plain text") and accept(auto, "let me look " + two)
    assert not accept(auto, '[TOOL_CALLS][{"name": "f0", "arguments": {}}]')


def _use(fmt: str, choice: str = "auto") -> ToolUse:
    return ToolUse(choice, frozenset({"f0", "f1"}), None, None, fmt)


@pytest.mark.parametrize("fmt, text", [
    ("llama3", '{"name": "f0", "parameters": {"n": 3}}; {"name": "f1", "parameters": {}}'),
    ("llama3", '<|python_tag|>{"name": "f0", "parameters": {"n": 3}}; '
               '{"name": "f1", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS][{"name": "f0", "arguments": {"n": 3}}, '
                '{"name": "f1", "arguments": {}}]'),
])
def test_the_models_format_is_parsed_whole_and_streamed(fmt, text):
    message, finish = _use(fmt).message(text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] \
        == [("f0", '{"n": 3}'), ("f1", "{}")]
    assert _use("hermes").message(text, "stop")[0] == {"role": "assistant", "content": text}
    stream = _use(fmt).stream()
    deltas = [d for i in range(0, len(text), 5) for d in stream.feed(text[i:i + 5])]
    deltas += stream.finish()
    calls = [d["tool_calls"][0] for d in deltas]
    named = [c for c in calls if "id" in c]
    assert [(c["index"], c["function"]["name"]) for c in named] == [(0, "f0"), (1, "f1")]
    assert len(calls) > 3   # the first call's arguments came in pieces after its name
    assert ["".join(c["function"]["arguments"] for c in calls if c["index"] == i)
            for i in (0, 1)] == ['{"n": 3}', "{}"]
    assert stream.calls == 2


# How each family's template writes back an earlier call (written here, in their style).
LLAMA3_HISTORY = ('{%- for m in messages %}{%- if m.tool_calls %}{%- set c = '
                  'm.tool_calls[0].function %}{"name": "{{ c.name }}", "parameters": '
                  '{{ c.arguments | tojson }}}{% else %}{{ m.content }}{% endif %}{% endfor %}')
MISTRAL_HISTORY = ('{%- for m in messages %}{%- if m.tool_calls %}[TOOL_CALLS][{%- for c in '
                   'm.tool_calls %}{"name": "{{ c.function.name }}", "arguments": '
                   '{{ c.function.arguments }}}{% endfor %}]{% endif %}{% endfor %}')


@pytest.mark.parametrize("template, written", [
    (LLAMA3_HISTORY, '{"name": "f0", "parameters": {"n":3, "s": "é"}}'),
    (MISTRAL_HISTORY, '[TOOL_CALLS][{"name": "f0", "arguments": {"n":3, "s": "é"}}]'),
    (CHAT_TEMPLATE, '<tool_call>\n{"name": "f0", "arguments": {"n":3, "s": "é"}}\n</tool_call>')])
def test_an_earlier_call_renders_back_as_the_model_wrote_it(tiny_model, template, written):
    from radixpool.tokenization import PromptTokenizer

    tokenizer = PromptTokenizer.from_dir(tiny_model)
    tokenizer.chat_template = template
    call = {"id": "c1", "type": "function",
            "function": {"name": "f0", "arguments": '{"n":3, "s": "é"}'}}
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": "", "tool_calls": [call]}]
    assert written in tokenizer.render_chat(messages, add_generation_prompt=False)
    assert call["function"]["arguments"] == '{"n":3, "s": "é"}'   # the request is left as sent


def test_a_chat_with_tools_renders_through_the_tool_use_template(tiny_model, tmp_path):
    """Hermes 2 Pro / Hermes 3 (Llama models) publish named templates: "default" knows nothing
    of tools, "tool_use" lists them. transformers picks "tool_use" for a chat with tools."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from radixpool.tokenization import PromptTokenizer

    path = tmp_path / "m"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "{% for t in tools %}<tools>{{ t.function.name }}"
                                         "</tools>{% endfor %}{% for m in messages %}"
                                         "{{ m.content }}{% endfor %}"}]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tools = [{"type": "function", "function": {"name": "f0", "parameters": SCHEMA}}]
    messages = [{"role": "user", "content": "go"}]
    ours, hf = PromptTokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    for extra in ({}, {"tools": tools}):
        assert ours.render_chat(messages, **extra) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra)
    assert ours.render_chat(messages, tools=tools) == "<tools>f0</tools>go"
