"""Bad input gets a 4xx naming the field, and everyone else keeps being served."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time

import httpx
import pytest

from radixpool.worker.server.request_checks import MAX_CHOICES

pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "hi"}]

# (path, body, status, param)
BAD = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": MSG}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MSG, "top_p": -0.1}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MSG, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "frequency_penalty": 3}, 400,
     "frequency_penalty"),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 99, "logprobs": True}, 400,
     "top_logprobs"),
    # numbers as strings or booleans are refused, as max_tokens "many" is (they were coerced)
    ("/v1/chat/completions", {"messages": MSG, "temperature": "0.5"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": True}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MSG, "top_p": "1"}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": False}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "min_p": "0.1"}, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": "10"}}, 400, "logit_bias.5"),
    # a penalty so small a positive logit divided by it overflowed: a 500 "non-finite logits"
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 5e-324}, 400, "repetition_penalty"),
    ("/generate", {"text": "x", "sampling_params": {"repetition_penalty": 1e-40}}, 400,
     "sampling_params.repetition_penalty"),
    # combinations OpenAI and vLLM refuse rather than ignore
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/chat/completions", {"messages": MSG, "modalities": ["text", "audio"]}, 400,
     "modalities"),
    ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"99999999": 1}}, 400,
     "logit_bias"),
    ("/v1/chat/completions", {"messages": MSG, "stop": [""]}, 400, "stop"),
    # a limit below the request's own min_tokens (it was cut to the limit without a word)
    ("/v1/chat/completions", {"messages": MSG, "min_tokens": 8, "max_tokens": 4}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "min_tokens": 8, "max_completion_tokens": 4}, 400,
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 8, "max_tokens": 4}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}, 400,
     "tools[0].function"),
    ("/v1/chat/completions", {"messages": MSG, "bogus_field": 1}, 400, "bogus_field"),
    # chat_template_kwargs may not stand in for what the renderer gives the template (bos_token
    # was a 400 naming messages; tools and raise_exception were taken silently), nor be
    # hundreds of variables, nor text the context cannot hold (a 1 MiB value was taken whole)
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {"bos_token": "<s>"}}, 400,
     "chat_template_kwargs.bos_token"),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {"tools": [
        {"type": "function", "function": {"name": "unchecked"}}]}}, 400,
     "chat_template_kwargs.tools"),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {
        "raise_exception": "off"}}, 400, "chat_template_kwargs.raise_exception"),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {
        f"k{i}": i for i in range(1000)}}, 400, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {
        "enable_thinking": False, "notes": "x" * (1 << 20)}}, 400, "chat_template_kwargs.notes"),
    ("/v1/chat/completions", {"messages": MSG, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": MSG, "include_stop_str_in_output": "yes"}, 400,
     "include_stop_str_in_output"),
    ("/v1/completions", {"prompt": "x", "include_stop_str_in_output": 1}, 400,
     "include_stop_str_in_output"),
    ("/generate", {"text": "x", "sampling_params": {"no_stop_trim": "true"}}, 400,
     "sampling_params.no_stop_trim"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 5000}]}, 400,
     "messages"),
    ("/v1/completions", {"prompt": 7}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ("/generate", {"sampling_params": {}}, 400, None),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400,
     "sampling_params.max_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"temprature": 1}}, 400,
     "sampling_params.temprature"),
    ("/generate", {"input_ids": []}, 400, "input_ids"),
    ("/generate", {"text": []}, 400, "text"),
    ("/prefix_probe", {"text": "x", "input_ids": [1]}, 400, None),
    # a lone UTF-16 surrogate is valid JSON syntax but no text: named, as the gateway names it
    ("/v1/completions", b'{"prompt": "w1 \\ud800 w2"}', 400, "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a \\udc80"}]}', 400,
     "messages[0].content"),
    ("/generate", b'{"text": ["w1", "w2 \\udc80"]}', 400, "text[1]"),
    # nested past the parser's depth: the field where it passes 200 levels, as the gateway
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + b"[" * 300
     + b"]" * 300 + b"}]}", 400, "messages[0].content[0][0][0][0][0]"),
    ("/generate", b'{"text": "x", "sampling_params": {"json_schema": ' + b'{"a":' * 300 + b"1"
     + b"}" * 300 + b"}}", 400, "sampling_params.json_schema.a.a.a.a.a.a"),
    # the same schema as JSON text, a string the body's parser does not look into: a 500 before
    ("/generate", {"text": "x", "sampling_params": {
        "json_schema": '{"a":' * 5000 + "1" + "}" * 5000}}, 400, "sampling_params.json_schema"),
    # ... and one that Python's parser cannot read again (nested past its stack): a 500 before
    ("/v1/completions", b'{"prompt": "\\ud800", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400,
     None),
]


def test_bad_input_is_answered_while_a_stream_completes(client, http):
    streamed: list[str] = []
    finish: list[str | None] = []

    def stream() -> None:
        for chunk in client.completions.create(model="tiny", prompt="a long story", stream=True,
                                               max_tokens=100, temperature=0,
                                               extra_body={"ignore_eos": True}):
            streamed.append(chunk.choices[0].text)
            finish.append(chunk.choices[0].finish_reason)

    thread = threading.Thread(target=stream)
    thread.start()
    failures = []
    for path, body, status, param in BAD:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(path, json=body)
        error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith(
            "application/json") else {}
        if r.status_code != status or error.get("param") != param or not error.get("message"):
            failures.append((path, body if len(str(body)) < 80 else "...", r.status_code,
                             r.text[:300]))
        assert error.get("type") == "invalid_request_error" or r.status_code >= 500
    thread.join(timeout=120)
    assert not failures, "\n".join(map(str, failures))
    assert finish[-1] == "length" and len(streamed) >= 1
    assert http.get("/health").status_code == 200


def test_unknown_route_and_method(http):
    r = http.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405


def test_a_prompt_longer_than_the_kv_pool_is_refused_naming_its_field(slow_prefill):
    # It fits the context (2,048) but not this worker's KV (1,600 tokens): /generate named no
    # field, and a batch of completions named `prompt` instead of the prompt at fault.
    url, long = slow_prefill.url, [9] * 1700
    cases = [
        ("/generate", {"input_ids": long}, "input_ids"),
        ("/generate", {"input_ids": [[5, 6], long]}, "input_ids[1]"),
        ("/generate", {"input_ids": long, "stream": True}, "input_ids"),
        ("/v1/completions", {"prompt": long, "max_tokens": 5}, "prompt"),
        ("/v1/completions", {"prompt": [[5, 6], long], "max_tokens": 5}, "prompt[1]"),
    ]
    for path, body, param in cases:
        r = httpx.post(url + path, json=body, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400, r.text
        assert (error["param"], error["code"]) == (param, "context_length_exceeded"), (path, error)
        assert "takes at most 1599" in error["message"]
    ok = httpx.post(url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200   # and it keeps serving


def test_a_default_output_length_is_cut_to_the_room_the_context_leaves(http):
    # A prompt 8 tokens short of the context: with max_tokens left out (16 by default), a
    # completion was refused, while with max_tokens null it was answered; /generate's default
    # of 128 was refused too. Defaults now end at the context; a length asked for must fit.
    long = [5] * 2040
    for body in ({"prompt": long}, {"prompt": long, "max_tokens": None}):
        r = http.post("/v1/completions", json={**body, "ignore_eos": True})   # to the very end
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 8
    r = http.post("/generate", json={"input_ids": long, "sampling_params": {"ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 8
    for path, body, param in [
        ("/v1/completions", {"prompt": long, "max_tokens": 16}, "max_tokens"),
        ("/generate", {"input_ids": long, "sampling_params": {"max_new_tokens": 128}},
         "sampling_params.max_new_tokens"),
    ]:
        r = http.post(path, json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and (error["param"], error["code"]) == (
            param, "context_length_exceeded"), error
        assert "ask for at most 8" in error["message"]


def test_a_request_for_too_many_completions_is_refused_naming_its_field(http):
    # Each completion is an engine request: a few hundred bytes asking for 100,000 of them kept
    # the worker busy for minutes instead of being refused.
    over = MAX_CHOICES + 1
    cases = [
        ("/generate", {"input_ids": [[1]] * over}, "input_ids"),
        ("/generate", {"text": ["a"] * over}, "text"),
        ("/generate", {"text": "a", "sampling_params": {"n": 100_000}}, "sampling_params.n"),
        ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{}, {"n": MAX_CHOICES}]},
         "sampling_params[1].n"),
        ("/generate", {"input_ids": [[1]] * 100_000, "stream": True}, "input_ids"),
        ("/v1/completions", {"prompt": [[1]] * over}, "prompt"),
        ("/v1/completions", {"prompt": [[1]] * (MAX_CHOICES // 128 + 1), "n": 128}, "n"),
    ]
    for path, body, param in cases:
        r = http.post(path, json=body, timeout=60)
        assert r.status_code == 400, (path, param, r.text[:300])
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (param, "too_many_choices"), (path, error)
        assert str(MAX_CHOICES) in error["message"]
    ok = http.post("/generate", json={"input_ids": [[5], [6]], "sampling_params": {
        "max_new_tokens": 2, "n": 2}})
    assert ok.status_code == 200 and len(ok.json()) == 4


def test_text_far_over_the_context_is_refused_before_it_is_tokenized(http):
    # Tokenizing takes ~250 bytes a character: 8 MiB of text grew the worker by 2 GiB only to
    # be refused for its length afterwards.
    def resident_bytes() -> float:
        metrics = http.get("/metrics").text
        return float(re.search(r"^process_resident_memory_bytes (\S+)$", metrics, re.M)[1])

    text = "a b " * (2 << 20)
    before = resident_bytes()
    for path, body, param in [
        ("/generate", {"text": text}, "text"),
        ("/generate", {"text": ["hi", text]}, "text[1]"),
        ("/v1/completions", {"prompt": text}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
    ]:
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
    assert resident_bytes() - before < 1 << 30
    assert http.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 2}}).status_code == 200


def _stall_while(base_url: str, send, stream) -> tuple[httpx.Response, list[float], float]:
    """`send()`'s response, the token arrival times of `stream()` (started first and running
    across it), and the longest the worker's event loop left `/livez` unanswered while `send`
    was in the worker, as a share of `send`'s time: a loaded machine stretches both. A stream's
    token gaps also count the CPU the request takes from the engine on a small machine, so
    they are not the measure here."""
    arrivals: list[float] = []
    answered: list[float] = []   # when each /livez was answered
    done = threading.Event()

    def run_stream() -> None:
        for _ in stream():
            arrivals.append(time.monotonic())

    def probe() -> None:
        with httpx.Client(base_url=base_url, timeout=60) as prober:
            while not done.is_set():
                assert prober.get("/livez").status_code == 200
                answered.append(time.monotonic())
                time.sleep(0.02)

    thread = threading.Thread(target=run_stream)
    thread.start()
    while len(arrivals) < 5 and thread.is_alive():
        time.sleep(0.01)
    prober = threading.Thread(target=probe)
    prober.start()
    while not answered and prober.is_alive():   # its first answer opens its connection
        time.sleep(0.01)
    started = time.monotonic()
    r = send()
    took = time.monotonic() - started
    done.set()
    prober.join(60)
    thread.join(120)
    # the stream ran across the request (on a loaded machine it may end before the answer)
    assert not thread.is_alive(), "the stream never ended"
    assert any(started < t < started + took for t in arrivals), \
        "no token arrived while the request was in the worker"
    inside = [started, *(t for t in answered if started < t < started + took), started + took]
    stall = max(later - earlier for earlier, later in itertools.pairwise(inside))
    return r, arrivals, stall / took


def _long_stream(client):
    return lambda: client.completions.create(model="tiny", prompt="a long story", stream=True,
                                             max_tokens=1500, temperature=0,
                                             extra_body={"ignore_eos": True})


def test_a_huge_body_does_not_stall_other_streams(client, http):
    # 8 MiB of one-id prompts takes seconds to validate, with the GIL held throughout: on the
    # event loop that streams every request's tokens, each stream stood still that long. Then
    # the validated batch came back from its child as 1.6M lists, unpickled with the GIL held:
    # the loop stood still for the last 2 s of the request's 7 s, only to refuse the batch.
    hostile = json.dumps({"input_ids": [[1]] * 1_600_000}).encode()
    r, _, stall = _stall_while(http.base_url, lambda: http.post(
        "/generate", content=hostile, headers={"content-type": "application/json"},
        timeout=120), _long_stream(client))
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_choices"
    assert stall < 0.15, f"/livez unanswered for {stall:.0%} of the request's time"


@pytest.mark.parametrize(("first", "extra", "status", "param"), [
    (MSG[0], {"model": "gpt-9"}, 404, "model"),
    ({"role": "tool", "content": "x"}, {}, 400, "messages[0].tool_call_id"),
    (MSG[0], {"tool_choice": "auto"}, 400, "tool_choice"),
    (MSG[0], {"regex": "a+", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "regex"),
])
def test_a_chat_too_long_for_the_context_is_refused_first_for_what_a_short_one_is(
        http, first, extra, status, param):
    # A chat whose messages are too long is refused where its body is validated; what the
    # handler refuses before measuring the prompt must still come first, word for word.
    answers = [http.post("/v1/chat/completions", json={"messages": [first, *MSG * count],
                                                       **extra}) for count in (0, 65_000)]
    assert [a.status_code for a in answers] == [status, status]
    assert answers[0].json()["error"]["param"] == param
    assert answers[0].content == answers[1].content


def test_a_long_template_variable_does_not_stall_other_streams(templated):
    # A template that prints a `chat_template_kwargs` value got it uncounted: 1 MiB of it was
    # rendered and tokenized on the event loop (/livez unanswered 2.4 s of the request's 5 s),
    # and the refusal named `messages`, which held one word.
    from openai import OpenAI

    client = OpenAI(base_url=f"{templated.url}/v1", api_key="unused", max_retries=0,
                    timeout=120)
    with httpx.Client(base_url=templated.url, timeout=120) as http:
        r, _, stall = _stall_while(http.base_url, lambda: http.post(
            "/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": {
                "preamble": "hello world " * 87_381}}), _long_stream(client))
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "context_length_exceeded", error
        assert stall < 0.15, f"/livez unanswered for {stall:.0%} of the request's time"
        assert error["param"] == "chat_template_kwargs.preamble", error
        r = http.post("/v1/chat/completions", json={
            "messages": MSG, "max_tokens": 2,
            "chat_template_kwargs": {"preamble": "You are terse."}})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > http.post("/v1/chat/completions", json={
            "messages": MSG, "max_tokens": 2}).json()["usage"]["prompt_tokens"]


def keys(count: int, prefix: str = "k") -> str:
    return ",".join(f'"{prefix}{i}":0' for i in range(count))


@pytest.mark.parametrize(("path", "body", "param", "code"), [
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"hi"}],' + keys(10**6)
     + "}", "k0", "unknown_field"),
    ("/v1/completions", '{"prompt":"hi","logit_bias":{' + keys(10**6, "") + "}}", None,
     "too_many_members"),
    ("/generate", '{"text":"hi","sampling_params":{"max_new_tokens":1,' + keys(10**6) + "}}",
     None, "too_many_members"),
])
def test_a_body_of_a_million_keys_is_refused_at_once_naming_the_problem(http, path, body,
                                                                       param, code):
    """Such a body made a million validation errors: their validation child ran out of memory
    reading them back and the client got a 413 after the child's whole 30 s limit."""
    r = http.post(path, content=body.encode(), headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and (error["param"], error["code"]) == (param, code), error
    assert http.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 2}}).status_code == 200
