"""The streamed tool-call parse, for each format: replies built from random text and random calls
(arguments with quotes, braces, escapes and call syntax inside strings), cut into random pieces,
give the calls and content they were built from, the same as the whole-reply parse; a call's
name comes before its arguments, whose pieces concatenate to the final arguments text; text
that may start a call is held until decided, never leaked as content."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from radixpool.worker.server.tool_parsers import (
    ArgumentsPiece,
    CallCut,
    CallStart,
    Content,
    ToolCallParser,
    parse_tool_calls,
)
from radixpool.worker.server.tool_use import ToolCallStream

NAMES = {"get_weather", "add", "x.y-z"}
# text built from the pieces of call syntax, so that near-misses are common
TRICKY = st.lists(st.sampled_from([*'ab {}[]"\\:;,\n<>/_é', "<tool_call>", "[TOOL_CALLS]", "<tool_",
                                   "[TOOL", "</tool_call>", '"name"', "<|python_tag|>"]),
                  max_size=12).map("".join)
# text written outside calls: anything but the start of a call
PROSE = st.lists(st.sampled_from([*'ab {}[]"\\:;,\n<>/_é', "<tool_", "[TOOL"]),
                 max_size=12).map("".join).filter(
                     lambda t: "<tool_call>" not in t and "[TOOL_CALLS]" not in t)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | TRICKY,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY, inner, max_size=3),
    max_leaves=8)


@st.composite
def arguments(draw) -> str:
    """A call's arguments as a model writes them under the grammar: `, ` and `: ` separators,
    with or without ASCII escapes."""
    value = draw(st.dictionaries(TRICKY, JSON_VALUES, max_size=4))
    return json.dumps(value, ensure_ascii=draw(st.booleans()), separators=(", ", ": "))


CALLS = st.lists(st.tuples(st.sampled_from(sorted(NAMES)), arguments()), min_size=1, max_size=3)


@st.composite
def hermes_reply(draw) -> tuple[str, list[tuple[str, str]], str]:
    calls = draw(CALLS)
    texts = [draw(PROSE) for _ in range(len(calls) + 1)]
    reply, content = texts[0], texts[0].rstrip()
    for (name, args), text in zip(calls, texts[1:]):
        reply += (f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n'
                  f"</tool_call>{text}")
        content += text.rstrip() if text.strip() else ""
    return reply, calls, content


@st.composite
def llama3_reply(draw) -> tuple[str, list[tuple[str, str]], str]:
    calls = draw(CALLS)
    lead = draw(st.sampled_from(["", " ", "<|python_tag|>", "\n<|python_tag|> "]))
    separator = draw(st.sampled_from(["; ", ";", "\n"]))
    return lead + separator.join(f'{{"name": {json.dumps(name)}, "parameters": {args}}}'
                                 for name, args in calls), calls, ""


@st.composite
def mistral_reply(draw) -> tuple[str, list[tuple[str, str]], str]:
    calls = draw(CALLS)
    text = draw(PROSE)
    body = ", ".join(f'{{"name": {json.dumps(name)}, "arguments": {args}}}' for name, args in calls)
    return f"{text}[TOOL_CALLS][{body}]", calls, text.rstrip()


REPLIES = {"hermes": hermes_reply(), "llama3": llama3_reply(), "mistral": mistral_reply()}


def _pieces(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _streamed(fmt: str, pieces: list[str]) -> tuple[list, ToolCallParser]:
    parser = ToolCallParser(fmt, NAMES)
    events = [event for piece in pieces for event in parser.feed(piece)]
    return events + parser.finish(), parser


def _check_order(events: list) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call, checking that a call starts before its pieces,
    the indices count up from 0, and no call was cut."""
    content, calls = "", []
    for event in events:
        assert not isinstance(event, CallCut)
        if isinstance(event, Content):
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index == len(calls) and event.name in NAMES
            calls.append((event.name, ""))
        else:
            assert isinstance(event, ArgumentsPiece) and event.index == len(calls) - 1
            calls[-1] = (calls[-1][0], calls[-1][1] + event.text)
    return content, calls


@settings(max_examples=150, deadline=None)
@given(data=st.data(), fmt=st.sampled_from(sorted(REPLIES)))
def test_any_split_of_a_reply_gives_its_calls_and_content(data, fmt):
    reply, calls, content = data.draw(REPLIES[fmt])
    events, parser = _streamed(fmt, _pieces(data.draw, reply))
    streamed_content, streamed_calls = _check_order(events)
    assert streamed_calls == calls and parser.calls == len(calls)
    assert streamed_content == content
    whole_content, whole_calls = parse_tool_calls(fmt, NAMES, reply)
    assert whole_content == (content or None)
    assert [(c.name, c.arguments) for c in whole_calls] == calls


@settings(max_examples=150, deadline=None)
@given(data=st.data(), fmt=st.sampled_from(sorted(REPLIES)))
def test_text_without_calls_streams_back_verbatim(data, fmt):
    text = data.draw(TRICKY)
    events, parser = _streamed(fmt, _pieces(data.draw, text))
    assert parser.calls == 0 and all(isinstance(e, Content) for e in events)
    assert "".join(e.text for e in events) == text
    assert parse_tool_calls(fmt, NAMES, text) == (text, [])


@settings(max_examples=100, deadline=None)
@given(data=st.data(), fmt=st.sampled_from(sorted(REPLIES)))
def test_a_reply_cut_anywhere_never_loses_or_invents_text(data, fmt):
    """Cut off by max_tokens: the finished calls stand, a cut call is reported, and every
    character is content, call syntax, or arguments text."""
    reply, calls, _ = data.draw(REPLIES[fmt])
    cut = reply[:data.draw(st.integers(0, len(reply)))]
    events, parser = _streamed(fmt, _pieces(data.draw, cut))
    started = [e.index for e in events if isinstance(e, CallStart)]
    finished = parser.calls
    assert started == list(range(len(started))) and finished <= len(started) <= finished + 1
    cuts = [e for e in events if isinstance(e, CallCut)]
    assert len(cuts) == len(started) - finished
    for index, (_, args) in enumerate(calls[:finished]):
        assert "".join(e.text for e in events
                       if isinstance(e, ArgumentsPiece) and e.index == index) == args
    assert all(len(e.text) <= len(cut) for e in events if isinstance(e, Content))


@settings(max_examples=100, deadline=None)
@given(data=st.data(), fmt=st.sampled_from(sorted(REPLIES)))
def test_a_reply_cut_anywhere_reads_whole_as_it_streams(data, fmt):
    """The non-streamed reply (`parse_tool_calls`) says what its stream said, a call cut off
    by max_tokens included: it was left in the content, as its stream had sent it as a call."""
    reply, _, _ = data.draw(REPLIES[fmt])
    cut = reply[:data.draw(st.integers(0, len(reply)))]
    events, _ = _streamed(fmt, _pieces(data.draw, cut))
    content, calls = "", {}
    for event in events:
        if isinstance(event, Content):
            content += event.text
        elif isinstance(event, CallStart):
            calls[event.index] = (event.name, "")
        elif isinstance(event, ArgumentsPiece):
            name, arguments = calls[event.index]
            calls[event.index] = (name, arguments + event.text)
    whole_content, whole_calls = parse_tool_calls(fmt, NAMES, cut)
    assert [(c.name, c.arguments) for c in whole_calls] == [calls[i] for i in sorted(calls)]
    assert whole_content == (content or None if calls else cut)
    assert calls or content == cut


def test_a_call_name_comes_as_soon_as_it_is_complete_then_arguments_in_pieces():
    parser = ToolCallParser("mistral", NAMES)
    assert parser.feed("Sure. [TOOL") == [Content("Sure.")]
    assert parser.feed('_CALLS][{"name": "ad') == []
    start, = parser.feed('d"')
    assert isinstance(start, CallStart) and (start.index, start.name) == (0, "add")
    assert start.id.startswith("call_")
    assert parser.feed(', "arguments": {"a"') == [ArgumentsPiece(0, '{"a"')]
    assert parser.feed(': "}"}') == [ArgumentsPiece(0, ': "}"}')]
    assert parser.feed("}, ") == []
    assert [type(e) for e in parser.feed('{"name": "add", "arguments": {}}]')] == [
        CallStart, ArgumentsPiece]
    assert parser.finish() == [] and parser.calls == 2


def test_held_text_is_released_once_it_cannot_start_a_call():
    hermes = ToolCallParser("hermes", NAMES)
    assert hermes.feed("a <tool") == [Content("a")]
    assert hermes.feed("box> b") == [Content(" <toolbox> b")]
    assert hermes.feed('<tool_call>\n{"name": "nope"') == [Content("<tool_call>"),
                                                           Content('\n{"name": "nope"')]
    llama = ToolCallParser("llama3", NAMES)
    assert llama.feed("  ") == [] and llama.feed("It is sunny") == [Content("  It is sunny")]
    assert llama.feed(' {"name": "add", "parameters": {}}') == [
        Content(' {"name": "add", "parameters": {}}')]
    assert llama.finish() == [] and llama.calls == 0


def test_the_sse_deltas_put_the_name_first_and_merge_adjacent_pieces():
    stream = ToolCallStream(ToolCallParser("hermes", NAMES))
    deltas = stream.feed('Hi <tool_call>\n{"name": "add", "arguments": {"a": ')
    assert deltas == [
        {"content": "Hi"},
        {"tool_calls": [{"index": 0, "id": deltas[1]["tool_calls"][0]["id"], "type": "function",
                         "function": {"name": "add", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}]
    assert stream.feed("1}}\n</tool_call>  ") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}]
    assert stream.finish() == [] and stream.calls == 1
