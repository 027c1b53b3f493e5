"""Native endpoints: /generate, /server_info, /tokenizer, /load, /prefix_probe, KV events."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from radixpool.protocol.kv_blocks import KVEvent, prefix_block_hashes
from radixpool.protocol.server_info import ServerInfo
from radixpool.tokenization import PromptTokenizer

pytestmark = pytest.mark.slow


def fresh_ids(n: int) -> list[int]:
    rng = random.Random()
    return [rng.randrange(5, 1000) for _ in range(n)]


def test_generate_text_and_input_ids(http):
    one = http.post("/generate", json={"text": "hello world", "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
    assert len(one["output_ids"]) == 6 and isinstance(one["text"], str)
    meta = one["meta_info"]
    assert meta["completion_tokens"] == 6 and meta["finish_reason"] == "length"
    assert meta["prompt_tokens"] > 0 and meta["cached_tokens"] >= 0
    tokenizer = PromptTokenizer(http.get("/tokenizer").json()["files"])
    ids = tokenizer.encode("hello world")
    again = http.post("/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
    assert again["output_ids"] == one["output_ids"]


def test_generate_batch_and_n(http):
    out = http.post("/generate", json={"input_ids": [[5, 6, 7], [8, 9, 10]], "sampling_params": {
        "max_new_tokens": 3, "n": 2, "temperature": 1.0, "seed": 3}}).json()
    assert isinstance(out, list) and len(out) == 4
    assert all(1 <= len(r["output_ids"]) <= 3 for r in out)


def test_every_choice_of_a_generate_answer_has_its_own_id(http):
    # n > 1 gave every choice the request's id: a client matching answers to ids saw one
    sp = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    cases = [({"input_ids": [5, 6, 7], "sampling_params": {**sp, "n": 3}, "rid": "r1"},
              ["r1-0", "r1-1", "r1-2"]),
             ({"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": [{**sp, "n": 2}, sp],
               "rid": "r2"}, ["r2-0", "r2-1", "r2-2"]),
             ({"input_ids": [5, 6, 7], "sampling_params": sp, "rid": "r3"}, "r3")]
    for body, want in cases:
        listed = http.post("/generate", json=body).json()
        got = [a["meta_info"]["id"] for a in listed] if isinstance(listed, list) \
            else listed["meta_info"]["id"]
        assert got == want
        with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
            streamed = {e["index"]: e["meta_info"]["id"] for e in _stream_events(r)}
        assert [streamed[i] for i in sorted(streamed)] == (want if isinstance(want, list)
                                                           else [want])


def test_a_streamed_batch_numbers_choices_as_the_answer_lists_them(http):
    # Prompts with different n: the event index was p * n_p + i, so prompt 0's second choice
    # and prompt 1's only one were both index 1.
    body = {"input_ids": [[5, 6, 7], [8, 9, 10], [11, 12]], "sampling_params": [
        {"max_new_tokens": 3, "n": 3, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 3, "n": 2, "temperature": 0, "ignore_eos": True}]}
    listed = http.post("/generate", json=body).json()
    streamed: dict[int, list[int]] = {}
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        for event in _stream_events(r):
            streamed.setdefault(event["index"], []).extend(event["output_ids"])
    assert sorted(streamed) == list(range(6))
    assert [streamed[i] for i in range(6)] == [answer["output_ids"] for answer in listed]


def test_generate_stream(http):
    body = {"input_ids": [5, 6, 7, 8], "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    events = []
    with http.stream("POST", "/generate", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    ids = [t for e in events for t in e["output_ids"]]
    full = http.post("/generate", json={**body, "stream": False}).json()
    assert ids == full["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == "length"
    assert "".join(e["text"] for e in events) == full["text"]


def test_server_info_and_tokenizer(http, worker):
    info = ServerInfo.from_json(http.get("/server_info").json())
    assert info.served_model_name == "tiny"
    assert info.context_length > 0 and info.kv_capacity_tokens > 0
    assert info.page_size >= 1 and info.kv_block_size >= info.page_size
    assert info.instance_id and info.version
    assert info.eviction_policy == "lru"  # the engine default, reported to the gateway
    assert info.schedule_policy == "lpm"  # ... which then sends its cache hits at once
    files = http.get("/tokenizer").json()["files"]
    tokenizer = PromptTokenizer(files)
    assert tokenizer.chat_template
    messages = [{"role": "user", "content": "hi there"}]
    probe = http.post("/prefix_probe", json={"messages": messages}).json()
    assert probe["prompt_tokens"] == len(tokenizer.encode_chat(messages))


def test_health_and_load(http):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    load = http.get("/load").json()
    assert set(load) >= {"running", "waiting", "kv_usage", "instance_id"}
    assert 0 <= load["kv_usage"] <= 1


def test_probe_and_events_agree_with_cache(http):
    info = http.get("/server_info").json()
    block = info["kv_block_size"]
    snap = http.get("/kv_events/snapshot").json()
    ids = fresh_ids(5 * block + 3)
    salt = "probe-test"
    assert http.post("/prefix_probe", json={"input_ids": ids, "cache_salt": salt}
                     ).json() == {"prompt_tokens": len(ids), "cached_tokens": 0}
    http.post("/generate", json={"input_ids": ids, "cache_salt": salt,
                                 "sampling_params": {"max_new_tokens": 1}})
    cached = http.post("/prefix_probe", json={"input_ids": ids, "cache_salt": salt}
                       ).json()["cached_tokens"]
    assert cached >= 5 * block   # every whole block of the prompt is held
    # the same salt on a real request reports what the probe said
    again = http.post("/generate", json={"input_ids": ids, "cache_salt": salt,
                                         "sampling_params": {"max_new_tokens": 1}}).json()
    assert again["meta_info"]["cached_tokens"] == min(cached, len(ids) - 1)
    # the event stream announced exactly the prompt's blocks, in the salt's namespace
    r = http.get("/kv_events", params={"since": snap["seq"], "timeout": 0, "queued": 1}).json()
    assert r["instance_id"] == snap["instance_id"]
    events = [KVEvent.from_json(e) for e in r["events"]]
    assert [e.seq for e in events] == list(range(snap["seq"] + 1, r["next"] + 1))
    # each request was announced (queued) with its prompt's blocks before its prefill ended;
    # a reader that does not ask for them (an older gateway) never sees one, and skips them
    queued = [e for e in events if e.type == "queued"]
    assert len(queued) == 2 and queued[0].blocks[:5] == tuple(
        int(h) for h in prefix_block_hashes(ids, block, salt)[:5])
    plain = http.get("/kv_events", params={"since": snap["seq"], "timeout": 0}).json()
    assert plain["next"] == r["next"]
    assert [e for e in plain["events"] if e["type"] == "queued"] == []
    assert len(plain["events"]) == len(events) - 2
    stored = {h for e in events if e.type == "stored" for h in e.blocks}
    hashes = [int(h) for h in prefix_block_hashes(ids, block, salt)]
    assert set(hashes[:5]) <= stored
    unsalted = [int(h) for h in prefix_block_hashes(ids, block)]
    assert not set(unsalted) & stored
    snapshot = {int(h, 16) for h in http.get("/kv_events/snapshot").json()["blocks"]}
    assert set(hashes[:5]) <= snapshot


def test_a_probe_sent_as_curl_sends_it_is_read_as_json(http):
    # `curl -d '{...}'` labels the body a form: /generate read it as JSON, /prefix_probe gave a
    # 400 "Input should be a valid dictionary", so the protocol doc's probe failed from a shell
    form = {"content-type": "application/x-www-form-urlencoded"}
    body = json.dumps({"input_ids": [5, 6, 7]})
    r = http.post("/prefix_probe", content=body, headers=form)
    assert r.status_code == 200 and r.json()["prompt_tokens"] == 3
    for bad in ("input_ids=5", '{"text": ' + "[" * 5000 + "]" * 5000 + "}"):
        r = http.post("/prefix_probe", content=bad, headers=form)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_kv_events_resync_and_flush(http):
    last = http.get("/kv_events/snapshot").json()
    r = http.get("/kv_events", params={"since": last["seq"] + 1000, "timeout": 0})
    assert r.status_code == 409 and r.json()["error"]["code"] == "resync_required"
    before = http.get("/server_info").json()["instance_id"]
    assert http.post("/flush_cache").status_code == 200
    after = http.get("/server_info").json()
    assert after["instance_id"] != before
    events = http.get("/kv_events", params={"since": last["seq"], "timeout": 0})
    if events.status_code == 200:
        assert "cleared" in [e["type"] for e in events.json()["events"]]
    assert http.get("/kv_events/snapshot").json()["blocks"] == []


def test_the_kv_stream_says_the_load_and_answers_a_reader_when_it_changes(http):
    """Several gateways follow one worker's KV stream; each counts only the requests it sent, so
    the stream says how many the worker holds, and answers a reader (`load=` what it last saw)
    when that changes, not only when the cache does."""
    seq = http.get("/kv_events/snapshot").json()["seq"]
    idle = http.get("/kv_events", params={"since": seq, "timeout": 0}).json()
    assert idle["load"] == {"requests": 0}
    start = time.monotonic()   # a reader that saw 0: nothing changes, it waits its timeout
    quiet = http.get("/kv_events", params={"since": seq, "timeout": 0.5, "load": 0}).json()
    assert time.monotonic() - start >= 0.45 and quiet["events"] == []
    answers: list[tuple[float, dict]] = []

    def reader() -> None:   # parked before the request arrives
        doc = http.get("/kv_events", params={"since": seq, "timeout": 20, "load": 0},
                       timeout=30).json()
        answers.append((time.monotonic(), doc))

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.3)
    assert not answers, "a reader whose load is current waits"
    body = {"input_ids": fresh_ids(10), "stream": True,
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=body) as r:
        sent = time.monotonic()
        events = _stream_events(r)
        next(events)
        thread.join(20)
        assert answers, "the reader was not answered when the request arrived"
        answered, doc = answers[0]
        assert answered - sent < 5 and doc["load"]["requests"] >= 1
        during = http.get("/kv_events", params={"since": doc["next"], "timeout": 0}).json()
        assert during["load"] == {"requests": 1}
        start = time.monotonic()   # a reader that saw another figure is answered at once
        stale = http.get("/kv_events", params={"since": during["next"], "timeout": 10,
                                               "load": 0}).json()
        assert time.monotonic() - start < 2 and stale["load"] == {"requests": 1}
        list(events)
    assert http.get("/kv_events", params={"since": seq, "timeout": 0}).json()["load"] == {
        "requests": 0}


def _stream_events(response):
    """The events of a streaming /generate response, as they come."""
    lines = (line for line in response.iter_lines() if line.startswith("data: "))
    return (json.loads(line[6:]) for line in lines if line != "data: [DONE]")


def test_flush_with_a_request_in_flight_answers_409_at_once(http):
    before = http.get("/server_info").json()["instance_id"]
    body = {"input_ids": fresh_ids(10), "stream": True,
            "sampling_params": {"max_new_tokens": 100, "temperature": 0, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=body) as r:
        events = _stream_events(r)
        tokens = next(events)["output_ids"]
        refused = http.post("/flush_cache", timeout=10)   # the old flush waited, here for minutes
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "requests_in_flight" and error["type"] == "invalid_request_error"
        assert "in flight" in error["message"] and "1 running" in error["message"]
        rest = list(events)
    tokens += [t for e in rest for t in e["output_ids"]]
    assert len(tokens) == 100 and rest[-1]["meta_info"]["finish_reason"] == "length"
    assert http.get("/server_info").json()["instance_id"] == before   # nothing was flushed
    flushed = http.post("/flush_cache")   # idle now: flushes as before
    assert flushed.status_code == 200 and flushed.json()["instance_id"] != before


def test_a_rid_in_flight_gets_400_and_the_first_request_keeps_its_tokens(http):
    prompt, other = fresh_ids(12), fresh_ids(12)
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    expected = http.post("/generate", json={"input_ids": prompt, "sampling_params": params}
                         ).json()["output_ids"]
    rid = f"dup-{random.randrange(1 << 30)}"
    body = {"input_ids": prompt, "sampling_params": params, "rid": rid, "stream": True}
    with http.stream("POST", "/generate", json=body) as r:
        events = _stream_events(r)
        tokens = next(events)["output_ids"]
        for second in ({"input_ids": other, "sampling_params": params, "rid": rid},
                       {"text": "x", "sampling_params": {**params, "n": 2}, "rid": rid,
                        "stream": True}):
            dup = http.post("/generate", json=second, timeout=10)
            assert dup.status_code == 400, dup.text
            error = dup.json()["error"]
            assert error["param"] == "rid" and rid in error["message"]
        tokens += [t for e in events for t in e["output_ids"]]
    assert tokens == expected
    again = http.post("/generate", json={"input_ids": prompt, "sampling_params": params,
                                         "rid": rid})
    assert again.status_code == 200 and again.json()["output_ids"] == expected


def test_a_probe_of_millions_of_ids_is_answered_and_the_worker_keeps_serving(http):
    # A 16 MiB body (under the limit) sent all its ids to the engine core in one message: the
    # pipe refused it, and every later request failed with "the engine core process died".
    ids = fresh_ids(32)
    http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    huge = ids + [7] * 8_000_000
    probe = http.post("/prefix_probe", json={"input_ids": huge})
    assert probe.status_code == 200, probe.text[:300]
    assert probe.json()["prompt_tokens"] == len(huge)
    assert probe.json()["cached_tokens"] >= 31   # the cached prefix, as for the short prompt
    after = http.post("/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 2}})
    assert after.status_code == 200 and after.json()["meta_info"]["completion_tokens"] == 2
