"""Large request bodies are parsed, validated and keyed in child processes: the same answer as in
place, no stall of other requests however hostile the body, a 413 for a body too big to parse
within the memory limit, and no request lost when a parse process dies."""

from __future__ import annotations

import json
import os
import signal

import httpx
import numpy as np
import pytest

from bench.simfleet import sim_tokenizer_files
from radixpool.gateway.body_parsing import INLINE_BODY_BYTES, BodyParser, parse_body
from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.route_key import BadRequest, KeyBuilder
from radixpool.gateway.server import GatewayServer
from radixpool.tokenization import PromptTokenizer
from tests.gateway.conftest import latencies_during, words


@pytest.fixture(scope="module")
def tokenizer():
    return PromptTokenizer(sim_tokenizer_files())


def large(doc: dict) -> bytes:
    body = json.dumps(doc).encode()
    assert len(body) > INLINE_BODY_BYTES
    return body


def same(a, b) -> bool:
    return (a.key.hashes == b.key.hashes and a.key.units == b.key.units
            and a.key.exact == b.key.exact and a.key.model == b.key.model
            and a.key.salt == b.key.salt
            and np.array_equal(np.asarray(a.key.head), np.asarray(b.key.head))
            and a.body == b.body and a.strip_usage == b.strip_usage)


def test_a_parse_process_gives_what_parsing_in_place_gives(loop_thread, tokenizer):
    keys = KeyBuilder(64, 256, 64 * 1024)
    keys.use_tokenizer(tokenizer, 16)
    parser = BodyParser(keys, 1, 256 << 20)
    long_text = words(0, 6000)
    cases = [
        ("/v1/chat/completions", {"model": "m", "cache_salt": "s", "messages": [
            {"role": "system", "content": long_text}, {"role": "user", "content": "w1 w2"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}],
                                  "stream": True}),
        ("/v1/completions", {"prompt": words(5, 30_000), "stream": True,  # cut at 64 Ki chars
                             "stream_options": {"continuous_usage_stats": False}}),
        ("/generate", {"input_ids": list(range(9000)), "stream": True}),
    ]
    try:
        for path, doc in cases:
            body = large(doc)
            got = loop_thread.run(parser.parse(path, body))
            assert same(got, parse_body(keys, path, body)), (path, doc.keys())
        streamed = loop_thread.run(parser.parse(*cases[1][0:1], large(cases[1][1])))
        assert streamed.strip_usage and json.loads(streamed.body)["stream_options"] == {
            "include_usage": True}
        # a refusal keeps the field it names and its code across the process boundary
        bad = large({"messages": [{"role": "user", "content": long_text}, "not a message"]})
        with pytest.raises(BadRequest) as refused:
            loop_thread.run(parser.parse("/v1/chat/completions", bad))
        assert refused.value.param == "messages[1]"
        with pytest.raises(BadRequest) as refused:
            loop_thread.run(parser.parse("/v1/completions", b"{" + b" " * INLINE_BODY_BYTES))
        assert refused.value.code == "invalid_json"
    finally:
        parser.close()


def test_the_parse_processes_follow_the_keys_when_a_tokenizer_arrives(loop_thread, tokenizer):
    keys = KeyBuilder(64, 256)
    parser = BodyParser(keys, 1, 256 << 20)
    body = large({"prompt": words(0, 5000)})
    try:
        assert not loop_thread.run(parser.parse("/v1/completions", body)).key.exact  # text
        keys.use_tokenizer(tokenizer, 16)   # as the monitor does once a worker's arrives
        key = loop_thread.run(parser.parse("/v1/completions", body)).key
        assert key.exact and key.units == 5000
    finally:
        parser.close()


def test_a_hostile_body_does_not_hold_up_small_requests(loop_thread):
    # 8 MiB of tiny nested arrays: about a second of `json.loads`, all of it holding the GIL.
    # Parsed in the gateway's process (on a thread or not), every small request waited for it.
    server = GatewayServer(GatewayConfig(host="127.0.0.1", port=0))
    loop_thread.run(server.start())
    url = f"http://127.0.0.1:{server.port}"
    hostile = json.dumps({"messages": [[1]] * 1_600_000}).encode()
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            # the parse processes start on the first large body: not part of what is measured
            assert c.post("/v1/completions", content=large({"prompt": words(0, 5000)})
                          ).status_code == 503   # parsed, keyed, and no worker to take it
            latencies, big_latency, r = latencies_during(
                url, lambda: c.post("/v1/chat/completions", content=hostile))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0]"
        # loose and relative to the big request: the test's own threads share a GIL with the
        # gateway's event loop
        assert len(latencies) >= 5
        assert max(latencies) < 0.5 * big_latency, (max(latencies), big_latency)
    finally:
        loop_thread.run(server.stop())


def test_a_body_too_big_to_parse_gets_413_and_nothing_else_is_lost(make_stack):
    stack = make_stack(1, parse_memory_bytes=16 << 20)
    # 4 MiB of one-id prompts (a /generate batch): ~100 MiB once parsed
    r = stack.client.post("/generate", content=json.dumps({"input_ids": [[1]] * 800_000}))
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and "parse memory limit" in error["message"]
    assert stack.client.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 2}
                             ).status_code == 200
    r = stack.client.post("/v1/completions", content=large(
        {"prompt": words(0, 5000), "max_tokens": 2}))
    assert r.status_code == 200   # large bodies are still parsed
    stack.settle()
    metrics = stack.client.get("/metrics").text
    assert 'radixpool_gateway_requests_total{code="413",worker="gateway"} 1' in metrics


def test_a_parse_process_killed_between_requests_costs_no_request(make_stack):
    stack = make_stack(1)
    body = large({"prompt": words(0, 5000), "max_tokens": 2})
    assert stack.client.post("/v1/completions", content=body).status_code == 200
    pool = stack.gateway.bodies.children._pool
    for pid in list(pool._processes):   # as the kernel's OOM killer would
        os.kill(pid, signal.SIGKILL)
    assert stack.client.post("/v1/completions", content=body).status_code == 200
    assert stack.gateway.bodies.children._pool is not pool   # started anew


def test_a_body_of_a_million_keys_is_refused_by_the_gateway(make_stack):
    """It went on to a worker, which held a validation child for 30 s over it; now the gateway
    answers 400 after one parse, and the worker never sees it."""
    stack = make_stack(1)
    members = ",".join(f'"k{i}":0' for i in range(10**6))
    hostile = '{"messages":[{"role":"user","content":"w1"}],' + members + "}"
    r = stack.client.post("/v1/chat/completions", content=hostile.encode())
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_members"
    assert "131072 members" in r.json()["error"]["message"]
    assert stack.client.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 2}
                             ).status_code == 200
    stack.settle()
    assert "radixpool_gateway_requests_total{code=\"400\",worker=\"gateway\"} 1" \
        in stack.client.get("/metrics").text


def test_large_legal_bodies_are_under_the_member_bound():
    keys = KeyBuilder(64, 256, 64 * 1024)
    bodies = [   # the first has more colons than the bound allows members: it is counted
        ("/v1/completions", {"prompt": " ".join(f"w{i}:" for i in range(200_000)),
                             "max_tokens": 1,
                             "logit_bias": {str(t): -1.0 for t in range(120_000)}}),
        ("/generate", {"input_ids": list(range(100_000)), "sampling_params": {
            "max_new_tokens": 1}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"w{i}: {i}"}
                                               for i in range(30_000)]}),
    ]
    for path, doc in bodies:
        assert parse_body(keys, path, large(doc)).key.units > 0


@pytest.mark.parametrize("include_usage", [None, 0, ""])
def test_a_stream_option_the_workers_refuse_reaches_them_as_sent(include_usage):
    """`include_usage` must be a boolean: the workers answer null, 0 or "" with a 400 naming
    it. The gateway once overwrote any false-ish value with its own `true`, so the client got a
    200 through the gateway where the worker refuses the request."""
    keys = KeyBuilder(64, 256, 64 * 1024)
    body = json.dumps({"prompt": "w1 w2", "stream": True,
                       "stream_options": {"include_usage": include_usage}}).encode()
    parsed = parse_body(keys, "/v1/completions", body)
    assert parsed.body == body and not parsed.strip_usage
    declined = json.dumps({"prompt": "w1 w2", "stream": True,
                           "stream_options": {"include_usage": False}}).encode()
    assert json.loads(parse_body(keys, "/v1/completions", declined).body)["stream_options"] \
        == {"include_usage": True}   # false is the client declining: asked for, then stripped
