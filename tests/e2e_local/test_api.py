"""The OpenAI API through the gateway of a local fleet, with the official `openai` SDK: chat and
completions, streamed and not; cached tokens on a repeated prefix; the gateway's and the workers'
token counters agree."""

from __future__ import annotations

import json
import re

import openai
import pytest

from .fleet_probes import MODEL, eventually, gateway_view, long_text, scrape

pytestmark = pytest.mark.slow

def test_chat_and_completions_streamed_and_not(sdk):
    chat = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=6,
        temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage.prompt_tokens > 0 and chat.usage.completion_tokens <= 6

    stream = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=6,
        temperature=0, stream=True)
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content  # greedy: the same answer either way
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # not asked for, so not shown

    completion = sdk.completions.create(model=MODEL, prompt="The radix tree", max_tokens=5,
                                        temperature=0)
    pieces = list(sdk.completions.create(model=MODEL, prompt="The radix tree", max_tokens=5,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == completion.choices[0].text
    assert pieces[-1].usage.prompt_tokens == completion.usage.prompt_tokens

    assert [m.id for m in sdk.models.list().data] == [MODEL]


def test_a_repeated_prefix_is_served_from_cache(sdk):
    system = {"role": "system", "content": long_text(1)}
    first = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=[system, {"role": "user", "content": "first question"}],
        max_tokens=2, temperature=0)
    second = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=[system, {"role": "user", "content": "another question"}],
        max_tokens=2, temperature=0)
    assert first.parse().usage.prompt_tokens_details.cached_tokens < 20
    assert second.parse().usage.prompt_tokens_details.cached_tokens > 180
    # the gateway sent the second request where the prefix was
    assert second.headers["x-radixpool-worker"] == first.headers["x-radixpool-worker"]


def test_gateway_and_worker_token_counters_agree(fleet, sdk):
    def totals():
        workers = [scrape(url) for url in fleet.worker_urls]
        gateway = scrape(fleet.gateway.url)
        return (gateway.get("radixpool_gateway_prompt_tokens_total", 0),
                sum(w.get("radixpool_prompt_tokens_total", 0) for w in workers),
                gateway.get("radixpool_gateway_cached_tokens_total", 0),
                sum(w.get("radixpool_cached_prompt_tokens_total", 0) for w in workers))

    before = totals()
    client_prompt = client_cached = 0
    for i in range(4):
        messages = [{"role": "system", "content": long_text(10 + i % 2, 120)},
                    {"role": "user", "content": f"question {i}"}]
        answer = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                             temperature=0)
        client_prompt += answer.usage.prompt_tokens
        client_cached += answer.usage.prompt_tokens_details.cached_tokens
        chunks = list(sdk.completions.create(
            model=MODEL, prompt=long_text(20 + i % 2, 100), max_tokens=3, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        client_prompt += chunks[-1].usage.prompt_tokens
        client_cached += chunks[-1].usage.prompt_tokens_details.cached_tokens

    def moved():
        return tuple(a - b for a, b in zip(totals(), before))

    eventually(lambda: moved()[0] == client_prompt, "gateway counted every prompt token")
    gw_prompt, w_prompt, gw_cached, w_cached = moved()
    assert gw_prompt == w_prompt == client_prompt
    assert gw_cached == w_cached == client_cached > 0


def test_structured_output_through_the_gateway(fleet, sdk):
    """A constrained request routed by the gateway gets what each worker gives directly; a bad
    schema is a 400 through the gateway too; and the next turn, which carries the constrained
    answer (forced text appended by jump-forward), hits the worker's cache where the gateway
    predicted, without the gateway over-predicting."""
    schema = {"type": "object", "required": ["answer"], "additionalProperties": False,
              "properties": {"answer": {"type": "string", "pattern": "^[a-z]{1,8}$"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    messages = [{"role": "system", "content": long_text(31, 150)},
                {"role": "user", "content": "answer in JSON"}]
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, response_format=fmt)
    reply, owner = raw.parse(), raw.headers["x-radixpool-worker"]
    content = reply.choices[0].message.content
    doc = json.loads(content)
    assert set(doc) == {"answer"} and re.fullmatch("[a-z]{1,8}", doc["answer"])
    assert reply.choices[0].finish_reason == "stop"

    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "x", "schema": {"type": "nope"}}})
    assert bad.value.body["param"] == "response_format" and "nope" in bad.value.body["message"]

    view = gateway_view(fleet.gateway.url)[owner]
    # our workers run cached prompts first: the gateway sends them their cache hits at once
    assert view["schedule_policy"] == "lpm" and view["eviction_policy"]
    turn = messages + [{"role": "assistant", "content": content},
                       {"role": "user", "content": "and once more"}]
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=turn, max_tokens=40, temperature=0, response_format=fmt)
    assert raw.headers["x-radixpool-worker"] == owner
    cached = raw.parse().usage.prompt_tokens_details.cached_tokens
    assert cached >= reply.usage.prompt_tokens   # the whole first prompt, and more
    eventually(lambda: gateway_view(fleet.gateway.url)[owner]["requests"] > view["requests"],
               "the gateway booked the second turn")
    after = gateway_view(fleet.gateway.url)[owner]
    predicted = after["predicted_cached_tokens"] - view["predicted_cached_tokens"]
    assert reply.usage.prompt_tokens - 16 <= predicted <= cached
    assert after["tree_corrections"].get("cached_tokens", 0) == \
        view["tree_corrections"].get("cached_tokens", 0)
    for url in fleet.worker_urls:   # the same answer from every worker, asked directly
        direct = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat \
            .completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                response_format=fmt)
        assert direct.choices[0].message.content == content
        assert direct.usage.completion_tokens == reply.usage.completion_tokens


def test_an_agent_loop_of_tool_calls_through_the_gateway(fleet, sdk):
    """Tool calls routed by the gateway: `required` gives a valid call; the next turn (the call
    and the tool's result appended) goes to the same worker and hits its cache for the whole
    first prompt, where the gateway predicted: its key renders the tools, the call and the
    result token-exactly as the worker does. (The call itself is reused up to its first token
    that the tokenizer would split otherwise: exact jump-forward keeps the model's own split.)"""
    import jsonschema

    schema = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"enum": ["Paris", "Oslo"]}}}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": schema}}]
    messages = [{"role": "system", "content": long_text(37, 150)},
                {"role": "user", "content": "the weather, please"}]
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=0)
    reply, owner = raw.parse(), raw.headers["x-radixpool-worker"]
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), schema)

    view = gateway_view(fleet.gateway.url)[owner]
    turn = messages + [message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                        "content": "sunny"}]
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=turn, tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=0)
    assert raw.headers["x-radixpool-worker"] == owner
    cached = raw.parse().usage.prompt_tokens_details.cached_tokens
    assert cached >= reply.usage.prompt_tokens
    eventually(lambda: gateway_view(fleet.gateway.url)[owner]["requests"] > view["requests"],
               "the gateway booked the second turn")
    after = gateway_view(fleet.gateway.url)[owner]
    predicted = after["predicted_cached_tokens"] - view["predicted_cached_tokens"]
    assert reply.usage.prompt_tokens - 16 <= predicted <= cached
