"""What an OpenAI SDK user relies on beyond generating text, through the gateway of a local fleet
and on its workers directly: request ids, model lookup, error shapes that do not depend on who
refused, token bytes in logprobs, and constrained text made of multi-byte characters."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from .fleet_probes import MODEL

pytestmark = pytest.mark.slow

# CJK, an emoji and a ZWJ family: the tiny model's byte-level BPE spells most of it in byte tokens
TARGET = "東京🎉 café 👩\u200d👩\u200d👧 ok"
MESSAGES = [{"role": "user", "content": "Say it"}]


def spelled_bytes(token: str) -> bytes:
    """`bytes:\\xf0\\x9f` → b"\\xf0\\x9f"."""
    return bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", token))


def direct(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_every_answer_carries_the_request_id_the_client_sent_or_a_new_one(fleet, sdk):
    worker = direct(fleet.worker_urls[0])
    for client in (sdk, worker):
        given = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_headers={"x-request-id": "abc-1"})
        assert given.request_id == "abc-1"
        assert given.headers.get_list("x-request-id") == ["abc-1"]   # once, not echoed twice
        fresh = [client.completions.with_raw_response.create(model=MODEL, prompt="x",
                                                             max_tokens=1).request_id
                 for _ in range(2)]
        assert all(fresh) and fresh[0] != fresh[1]
        with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=MESSAGES, max_tokens=2, stream=True,
                extra_headers={"x-request-id": "abc-2"}) as streamed:
            assert streamed.request_id == "abc-2"
        for bad in ({"temperature": 9},                       # refused by the worker
                    {"messages": [{"content": "no role"}]}):  # refused by the gateway itself
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES,
                                                  "max_tokens": 2, **bad},
                                               extra_headers={"x-request-id": "abc-3"})
            assert refused.value.request_id == "abc-3"
    # one with spaces or control characters is not echoed into a header: a new one is made
    r = httpx.get(fleet.base_url + "/models", headers={"x-request-id": "a b"})
    assert r.headers["x-request-id"] not in ("", "a b")


def test_a_model_is_looked_up_by_its_id(fleet, sdk):
    for client in (sdk, direct(fleet.worker_urls[0])):
        model = client.models.retrieve(MODEL)
        assert (model.id, model.object) == (MODEL, "model")
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("no-such-model")
        assert missing.value.body["code"] == "model_not_found"
        assert "no-such-model" in missing.value.body["message"]
        with pytest.raises(openai.NotFoundError) as missing:   # passed on quoted, whole
            client.models.retrieve("org/no such model")
        assert "org/no such model" in missing.value.body["message"]
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model="no-such-model", messages=MESSAGES,
                                           max_tokens=2)
        assert (missing.value.body["param"], missing.value.body["code"]) == \
            ("model", "model_not_found")


BAD_REQUESTS = [   # (what the SDK is asked, the param the refusal names)
    ({"messages": [{"content": "no role"}]}, "messages[0].role"),
    ({"messages": ["not an object"]}, "messages[0]"),
    ({"messages": []}, "messages"),
    ({"model": 5}, "model"),
    ({"temperature": 2.5}, "temperature"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_tokens": 1_000_000}, "max_tokens"),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
]


@pytest.mark.parametrize(("bad", "param"), BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
def test_a_refusal_reads_the_same_from_the_gateway_and_from_a_worker(fleet, sdk, bad, param):
    """Whether the gateway refuses a request itself or passes the worker's refusal on, the SDK
    sees the same status, type, param and code."""
    seen = []
    for client in (sdk, direct(fleet.worker_urls[0])):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES,
                                              "max_tokens": 2, **bad})
        body = refused.value.body
        seen.append((refused.value.status_code, body["type"], body["param"], body["code"]))
    assert seen[0] == seen[1]
    assert seen[0][2] == param


def test_a_pattern_of_multibyte_characters_streams_them_whole_and_keeps_the_fleet_up(fleet, sdk):
    """Jump-forward meets forced text that starts inside a character (the model wrote the first
    byte of an emoji): it must decode the rest token by token, not fail the engine, and so not
    every worker the gateway retries the request on."""
    pattern = re.escape(TARGET)
    answer = sdk.completions.create(model=MODEL, prompt="Say:", max_tokens=60, temperature=0,
                                    extra_body={"regex": pattern})
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (TARGET, "stop")
    chunks = [c.choices[0].text for c in sdk.completions.create(
        model=MODEL, prompt="Say:", max_tokens=60, temperature=0, stream=True,
        extra_body={"regex": pattern}) if c.choices]
    assert "".join(chunks) == TARGET and len(chunks) > 1
    assert not any("\ufffd" in chunk for chunk in chunks)   # no chunk splits a character
    schema = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"enum": ["東京🎉", "京都👩\u200d👧"]}}}
    reply = sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert reply.choices[0].message.content in ('{"city": "東京🎉"}', '{"city": "京都👩\u200d👧"}')
    for url in fleet.worker_urls:   # every worker still serves
        assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_logprob_bytes_spell_the_text_even_inside_a_character(sdk):
    pattern = re.escape(TARGET)
    reply = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60,
                                        temperature=0, logprobs=True, top_logprobs=2,
                                        extra_body={"regex": pattern})
    content = reply.choices[0].message.content
    entries = reply.choices[0].logprobs.content
    assert content == TARGET
    # the bytes join to the text (then the end-of-turn token, when the reply ends with one)
    assert b"".join(bytes(e.bytes) for e in entries).decode().startswith(content)
    assert not any("\ufffd" in e.token for e in entries)
    partial = [e for e in entries if e.token.startswith("bytes:")]   # as OpenAI spells them
    assert partial and all(bytes(e.bytes) == spelled_bytes(e.token) for e in partial)

    legacy = sdk.completions.create(model=MODEL, prompt="Say:", max_tokens=60, temperature=0,
                                    logprobs=2, extra_body={"regex": pattern})
    text, lp = legacy.choices[0].text, legacy.choices[0].logprobs
    assert text == TARGET
    # each token's offset is where its text starts (inside a character: where that one starts)
    assert lp.text_offset == sorted(lp.text_offset) and max(lp.text_offset) <= len(text)
    whole = [(t, o) for t, o in zip(lp.tokens, lp.text_offset, strict=True)
             if not t.startswith("bytes:") and o < len(text)]
    assert len(whole) > 4 and all(text.startswith(t, o) for t, o in whole)
    streamed = [c.choices[0].logprobs for c in sdk.completions.create(
        model=MODEL, prompt="Say:", max_tokens=60, temperature=0, logprobs=2, stream=True,
        extra_body={"regex": pattern}) if c.choices and c.choices[0].logprobs]
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [t for s in streamed for t in s.tokens] == lp.tokens


def test_the_sdks_other_chat_parameters_are_honoured_or_refused_by_name(sdk):
    """Parameters of OpenAI's own API are not "unrecognized": the hints are accepted (no effect
    here), the features this server lacks are refused saying so."""
    reply = sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, prompt_cache_key="tenant-7",
        safety_identifier="user-42", verbosity="low", prompt_cache_retention="in_memory")
    assert reply.choices[0].message.content is not None
    refusals = [({"moderation": {"model": "omni-moderation-latest"}}, "moderation", "supported"),
                ({"prompt_cache_options": {"ttl": "30m"}}, "prompt_cache_options", "supported"),
                ({"prompt_cache_retention": "24h"}, "prompt_cache_retention", "in_memory")]
    for bad, param, words in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **bad)
        assert refused.value.body["param"] == param and words in refused.value.body["message"]
