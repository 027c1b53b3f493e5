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
    _valid(reply.choices[0].message.tool_calls, only)


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
    history = MSG + [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    follow = clients[fmt].chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                                  tool_choice="none", max_tokens=5)
    assert follow.choices[0].message.content is not None
    assert follow.usage.prompt_tokens_details.cached_tokens > 0
