"""Structured output through a real worker, with the official `openai` SDK: `response_format`
(json_schema, json_object) on chat and completions, the `regex` / `ebnf` extensions, `/generate`;
streamed text and `usage` agree with the non-streamed answer; bad constraints are 400s that name
the problem, and the worker keeps serving; the grammar metrics move."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "score"],
          "properties": {"answer": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "score": {"type": "integer", "minimum": 0, "maximum": 10}}}
MSG = [{"role": "user", "content": "answer in JSON"}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


def test_chat_json_schema_streamed_and_not(client):
    reply = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=60,
                                           temperature=0, response_format=FORMAT)
    content = reply.choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=60, temperature=0, response_format=FORMAT,
        stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens

    for seed in range(3):   # sampled, not greedy: still valid every time
        reply = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=60,
                                               temperature=1.2, seed=seed, n=2,
                                               response_format=FORMAT)
        for choice in reply.choices:
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_and_regex_on_completions(client):
    reply = client.completions.create(model="tiny", prompt="the radix tree", max_tokens=16,
                                      temperature=1.0, seed=3,
                                      extra_body={"response_format": {"type": "json_object"}})
    text, reason = reply.choices[0].text, reply.choices[0].finish_reason
    assert text.startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert reason == "length" and reply.usage.completion_tokens == 16
    reply = client.completions.create(model="tiny", prompt="a date", max_tokens=30,
                                      temperature=1.0, seed=1,
                                      extra_body={"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])"})
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])", reply.choices[0].text)
    assert reply.choices[0].finish_reason == "stop"


def test_generate_with_each_constraint(http):
    cases = [({"json_schema": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
             ({"json_schema": json.dumps(SCHEMA)},
              lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
             ({"regex": "(red|green|blue)-[0-9]"},
              lambda t: re.fullmatch("(red|green|blue)-[0-9]", t) or pytest.fail(t)),
             ({"ebnf": 'root ::= "(" [a-c] ("," [a-c])? ")"'},
              lambda t: re.fullmatch(r"\([a-c](,[a-c])?\)", t) or pytest.fail(t))]
    for constraint, check in cases:
        r = http.post("/generate", json={"text": "x", "sampling_params": {
            "max_new_tokens": 60, "temperature": 0.9, "seed": 4, **constraint}})
        assert r.status_code == 200, r.text
        doc = r.json()
        check(doc["text"])
        assert doc["meta_info"]["finish_reason"] == "stop"
        assert doc["meta_info"]["completion_tokens"] == len(doc["output_ids"])


BAD = [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "nope"),
    ({"extra_body": {"regex": "[a-"}}, "regex", "regex"),
    ({"extra_body": {"ebnf": "root ::= missing_rule"}}, "ebnf", "missing_rule"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"regex": "a"}},
     "response_format", "both given"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    # nothing satisfies them: the answer was a 200 with empty text and finish_reason "stop"
    ({"extra_body": {"ebnf": "root ::= root"}}, "ebnf", "matches no output"),
    ({"extra_body": {"regex": "[^\\x00-\\U0010ffff]"}}, "regex", "matches no output"),
    # what the grammar engine would silently drop, so the output need not validate: refused
    *[({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}},
       "response_format", named) for bad, named in [
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "#/allOf"),
        ({"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:1/x.json"}}},
         "#/properties/a/$ref"),
        ({"type": "string", "pattern": "(?!x)a+"}, "#/pattern"),
        ({"type": "object", "properties": {"if": {"type": "integer"}},   # a property, not 'if'
          "if": {"required": ["if"]}, "then": {"required": ["x"]}}, "#/if"),
        # `not` was let through, and dropped: "a" was a valid output of this one
        ({"type": "object", "properties": {"not": {"type": "string", "not": {"const": "a"}}},
          "required": ["not"]}, "#/properties/not/not"),
        ({"type": "object", "properties": {"a": {"type": "string"}},
          "dependentSchemas": {"a": {"required": ["b"]}}}, "#/dependentSchemas"),
        # xgrammar lowered each by one keyword and dropped the one named: "abc", a "b" with no
        # "a", 1.2 and "2021-01-01" were valid outputs of these
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/s", "maxLength": 2}},
          "required": ["a"], "$defs": {"s": {"type": "string"}}}, "#/properties/a/maxLength"),
        ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
          "anyOf": [{"required": ["a"]}, {"required": ["a", "b"]}]}, "#/type"),
        ({"type": "number", "multipleOf": 0.5}, "#/multipleOf"),
        ({"type": "string", "format": "date", "pattern": "^2020-"}, "#/pattern"),
    ]],
]


@pytest.mark.parametrize("kwargs,param,named", BAD)
def test_bad_constraints_are_400s_naming_the_problem(client, kwargs, param, named):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5, **kwargs)
    error = info.value.body
    assert error["param"].startswith(param), error
    assert named in error["message"], error
    reply = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3)
    assert reply.choices[0].message.content is not None   # still serving


def test_a_pydantic_model_the_grammar_would_not_hold_is_refused_by_parse(client):
    """`parse` with a field of both a pattern and a length: xgrammar kept the pattern alone, so
    a 200 could carry a code of any length, which the model's validation then rejects."""
    class Item(pydantic.BaseModel):
        code: str = pydantic.Field(pattern=r"^[A-Z]+$", max_length=4)
        count: int = pydantic.Field(ge=0, le=9)

    with pytest.raises(openai.BadRequestError) as info:
        client.beta.chat.completions.parse(model="tiny", messages=MSG, max_tokens=20,
                                           response_format=Item)
    error = info.value.body
    assert error["param"].startswith("response_format"), error
    assert "#/properties/code/maxLength" in error["message"], error

    class Bounded(pydantic.BaseModel):   # what the grammar holds goes through, and parses
        code: str = pydantic.Field(pattern=r"^[A-Z]{1,4}$")
        count: int = pydantic.Field(ge=0, le=9)

    reply = client.beta.chat.completions.parse(model="tiny", messages=MSG, max_tokens=40,
                                               temperature=0, response_format=Bounded)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(reply.choices[0].message.parsed, Bounded)


def test_a_set_field_still_validates_as_a_list(client):
    """`uniqueItems` (a set type's schema) is not enforced but not refused either: the output
    is still a list of the items' type."""
    schema = {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "uniqueItems": True, "maxItems": 3}},
        "required": ["tags"]}
    reply = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert reply.choices[0].finish_reason == "stop"
    tags = json.loads(reply.choices[0].message.content)["tags"]
    assert all(isinstance(t, int) and 0 <= t <= 9 for t in tags) and len(tags) <= 3


def test_generate_bad_regex_names_the_field(http):
    r = http.post("/generate", json={"text": "x", "sampling_params": {"regex": "(unclosed"}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "sampling_params.regex"


def test_a_schema_nested_past_what_compiles_says_so(http):
    # as JSON text, it passes the body's depth check and the JSON parser; lowering it to a
    # grammar ran out of Python's stack, and the 400 said "maximum recursion depth exceeded"
    schema: dict = {"type": "string"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    r = http.post("/generate", json={"text": "x", "sampling_params": {
        "json_schema": json.dumps(schema), "max_new_tokens": 2}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "sampling_params.json_schema"
    assert "nests too deeply to compile" in error["message"], error
    assert http.post("/generate", json={"text": "x", "sampling_params": {
        "max_new_tokens": 1}}).status_code == 200


def test_grammar_metrics_move(client, http):
    def scrape() -> dict[str, float]:
        out = {}
        for line in http.get("/metrics").text.splitlines():
            if line.startswith("radixpool_grammar"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    schema = {"type": "object", "required": ["k"], "additionalProperties": False,
              "properties": {"k": {"enum": ["metrics", "test"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "m", "schema": schema}}
    before = scrape()
    for _ in range(3):
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=20,
                                       response_format=fmt)
    after = scrape()
    count = "radixpool_grammar_compile_seconds_count"
    assert after[count] - before.get(count, 0) == 1   # compiled once
    hits = "radixpool_grammar_cache_hits_total"
    assert after[hits] - before.get(hits, 0) == 2
