"""Tool calls through real workers whose tiny model has a Mistral-style or a Llama-3-style chat
template (the default tiny model's files, with only the template changed): the worker detects
the format from the template, the model writes `tool_choice="required"` and named calls in that
format (seen in the logprobs' tokens), and they come back as calls whose arguments validate,
non-streamed and streamed, through the official `openai` SDK."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
from openai import OpenAI
from test_tools_api import MSG, NAMED, SCHEMAS, TOOLS, _accumulate, _valid
from worker_process import WorkerProcess

pytestmark = pytest.mark.slow

_TURNS = ("{%- for m in messages %}"
          "{%- if m.role in ['user', 'system'] %}[INST] {{ m.content }} [/INST]"
          "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
          "{%- elif m.tool_calls %}CALLS{{ eos_token }}"
          "{%- else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
TEMPLATES = {
    "mistral": "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
               "[/AVAILABLE_TOOLS]{% endif %}" + _TURNS.replace(
                   "CALLS", '[TOOL_CALLS][{%- for c in m.tool_calls %}{"name": '
                   '{{ c.function.name | tojson }}, "arguments": {{ c.function.arguments }}}'
                   "{% if not loop.last %}, {% endif %}{% endfor %}]"),
    "llama3": "{{ bos_token }}{% if tools %}Call a function with JSON: {\"name\": function name, "
              "\"parameters\": its arguments}. {{ tools | tojson }}{% endif %}" + _TURNS.replace(
                  "CALLS", '{%- for c in m.tool_calls %}{"name": {{ c.function.name | tojson }}, '
                  '"parameters": {{ c.function.arguments }}}{% if not loop.last %}; {% endif %}'
                  "{% endfor %}"),
}


OPENING = {"mistral": '[TOOL_CALLS][{"name": "', "llama3": '{"name": "'}


@pytest.fixture(scope="module")
def clients(tiny_model, tmp_path_factory):
    procs = {}
    for fmt, template in TEMPLATES.items():
        model = tmp_path_factory.mktemp(f"tiny-{fmt}") / "model"
        shutil.copytree(tiny_model, model)
        config = json.loads((model / "tokenizer_config.json").read_text())
        (model / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                 "chat_template": template}))
        procs[fmt] = WorkerProcess(model, model.parent / "worker.log")
    try:
        clients = {fmt: OpenAI(base_url=f"{proc.wait_ready().url}/v1", api_key="unused",
                               max_retries=0, timeout=120) for fmt, proc in procs.items()}
        for fmt, proc in procs.items():
            assert f"tool calls {fmt}," in proc.log()   # detected from the template
        yield clients
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.mark.parametrize("fmt", list(TEMPLATES))
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_forced_calls_in_the_models_format_validate(clients, fmt, choice):
    client = clients[fmt]
    only = None if choice == "required" else "add"
    for seed in range(3):
        kwargs = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice=choice,
                      parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed)
        reply = client.chat.completions.create(**kwargs, n=2, logprobs=True)
        for c in reply.choices:
            raw = "".join(t.token for t in c.logprobs.content)   # what the model wrote
            assert raw.startswith(OPENING[fmt]) and "<tool_call>" not in raw, raw
            assert c.finish_reason == "tool_calls"
            assert c.message.content is None and len(c.message.tool_calls) == 1
            _valid(c.message.tool_calls, only)
        content, calls, finish = _accumulate(client.chat.completions.create(**kwargs,
                                                                            stream=True))
        assert finish == "tool_calls" and content is None and len(calls) == 1
        for name, arguments in calls:
            assert only in (None, name)
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    reply = client.chat.completions.create(   # parallel: one or more calls, each valid
        model="tiny", messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=400,
        temperature=1.0, seed=7)
    calls = reply.choices[0].message.tool_calls
    if reply.choices[0].finish_reason == "length":   # the last call cut off: its part so far
        calls = calls[:-1]
    _valid(calls, only)


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_streamed_calls_equal_the_non_streamed_ones(clients, fmt):
    kwargs = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required",
                  max_tokens=400, temperature=1.0, seed=3)
    reply = clients[fmt].chat.completions.create(**kwargs).choices[0]
    content, calls, finish = _accumulate(clients[fmt].chat.completions.create(**kwargs,
                                                                              stream=True))
    assert (content, finish) == (reply.message.content, reply.finish_reason)
    assert calls == [(c.function.name, c.function.arguments) for c in reply.message.tool_calls]


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_the_call_goes_back_into_the_next_turn(clients, fmt):
    reply = clients[fmt].chat.completions.create(
        model="tiny", messages=MSG, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=120, temperature=1.0, seed=5)
    call = reply.choices[0].message.tool_calls[0]
    history = MSG + [reply.choices[0].message,   # the SDK's object, as the README shows
                     {"role": "tool", "tool_call_id": call.id,
                      "content": [{"type": "text", "text": "sunny"}]}]
    follow = clients[fmt].chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                                  tool_choice="none", max_tokens=5)
    assert follow.choices[0].message.content is not None
    assert follow.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("fmt", list(TEMPLATES))
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_streamed_call_is_its_name_then_its_arguments_in_pieces(clients, fmt, choice):
    """Raw chunks: one delta with the call's id, type and name, then at least two pieces of
    arguments that validate once joined; the SDK's stream helper emits argument deltas and
    assembles the same call; usage comes last."""
    client = clients[fmt]
    only = None if choice == "required" else "add"
    kwargs = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice=choice,
                  parallel_tool_calls=False, max_tokens=120, temperature=1.0)
    for seed in range(2):
        chunks = list(client.chat.completions.create(
            **kwargs, seed=seed, stream=True, stream_options={"include_usage": True}))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert not any(d.content for d in deltas)   # no call syntax leaks into the text
        pieces = [d.tool_calls[0] for d in deltas if d.tool_calls]
        first, rest = pieces[0], pieces[1:]
        assert first.id.startswith("call_") and first.type == "function"
        assert first.function.name in SCHEMAS and only in (None, first.function.name)
        assert first.function.arguments == ""
        assert len(rest) >= 2 and all(p.index == 0 and p.id is None and p.function.name is None
                                      for p in rest)
        arguments = "".join(p.function.arguments for p in rest)
        jsonschema.validate(json.loads(arguments), SCHEMAS[first.function.name])
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0

        with client.chat.completions.stream(**kwargs, seed=seed) as stream:
            argument_deltas = sum(event.type == "tool_calls.function.arguments.delta"
                                  and event.arguments_delta != "" for event in stream)
            final = stream.get_final_completion()
        call, = final.choices[0].message.tool_calls
        assert argument_deltas == len(rest)
        assert call.id.startswith("call_")
        assert (call.function.name, call.function.arguments) == (first.function.name, arguments)


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_auto_gives_text_or_calls_the_same_streamed(clients, fmt):
    for seed in range(3):
        kwargs = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice="auto",
                      max_tokens=40, temperature=1.0, seed=seed)
        reply = clients[fmt].chat.completions.create(**kwargs).choices[0]
        if reply.message.tool_calls:
            _valid(reply.message.tool_calls)
        else:
            assert isinstance(reply.message.content, str)
        content, calls, finish = _accumulate(clients[fmt].chat.completions.create(**kwargs,
                                                                                  stream=True))
        assert (content, finish) == (reply.message.content, reply.finish_reason)
        assert calls == [(c.function.name, c.function.arguments)
                         for c in reply.message.tool_calls or []]
