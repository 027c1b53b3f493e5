"""The offline Engine API, with its core in a real separate process."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from radixpool.worker import Engine
from radixpool.worker.engine_errors import EngineBusy, RequestFault, RidInUse
from radixpool.worker.messages import GenerateRequest


@pytest.fixture(scope="module")
def engine(tiny_model):
    with Engine(str(tiny_model), device="cpu", kv_cache_tokens=4096,
                debug_invariants=True) as eng:
        yield eng


def test_generate_forms_and_shapes(engine):
    one = engine.generate("The cache token prefix", {"max_new_tokens": 5, "temperature": 0})
    assert set(one) == {"text", "output_ids", "meta_info"}
    assert len(one["output_ids"]) == one["meta_info"]["completion_tokens"] <= 5
    meta = one["meta_info"]
    assert meta["prompt_tokens"] > 0 and meta["finish_reason"] in ("stop", "length")

    batch = engine.generate(["a b c", "d e f"], {"max_new_tokens": 3})
    assert isinstance(batch, list) and len(batch) == 2
    forks = engine.generate("x y z", {"max_new_tokens": 4, "n": 3, "temperature": 1.0})
    assert len(forks) == 3
    ids = engine.generate(input_ids=[1, 50, 60, 70], sampling_params={"max_new_tokens": 2})
    assert ids["meta_info"]["prompt_tokens"] == 4


def test_n_forks_share_the_prompt_kv_however_short(engine):
    prompt = [1, *range(700, 712)]  # 13 tokens: shorter than one KV block
    forks = engine.generate(input_ids=prompt, sampling_params={
        "max_new_tokens": 4, "n": 3, "temperature": 1.0, "seed": 5})
    cached = sorted(f["meta_info"]["cached_tokens"] for f in forks)
    assert cached[0] < 12 and cached[1:] == [12, 12], "forks 1..n-1 reuse what fork 0 computed"
    assert len({tuple(f["output_ids"]) for f in forks}) > 1


def test_aborting_a_forked_request_ends_every_fork(engine):
    async def first_chunk_then_leave() -> None:
        async for _ in engine.stream(input_ids=[1, *range(720, 760)], sampling_params={
                "max_new_tokens": 300, "n": 3, "ignore_eos": True}):
            break

    asyncio.run(first_chunk_then_leave())
    deadline = time.monotonic() + 10
    while engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats().running == 0 and engine.stats().waiting == 0
    engine.check_invariants()



def test_an_abort_from_another_thread_as_the_forks_are_sent_ends_every_fork(engine,
                                                                            monkeypatch):
    # Fork 0's first token sends the other forks (from the thread reading the core's output);
    # the caller aborts from its own thread at that moment: no fork may run on for nobody.
    send, aborter = engine._send, []

    def send_racing_an_abort(msg):
        if isinstance(msg, GenerateRequest) and msg.rid.endswith("/1") and not aborter:
            aborter.append(threading.Thread(target=engine.abort, args=("raced",)))
            aborter[0].start()
            aborter[0].join(1.0)   # the abort lands between the hand-over and this send
        send(msg)

    monkeypatch.setattr(engine, "_send", send_racing_an_abort)

    async def collect() -> dict[int, list]:
        got: dict[int, list] = {}
        async for chunk in engine.stream(input_ids=[1, *range(730, 770)], rid="raced",
                                         sampling_params={"max_new_tokens": 200, "n": 2,
                                                          "ignore_eos": True}):
            got.setdefault(chunk.index, []).append(chunk)
        return got

    got = asyncio.run(collect())
    aborter[0].join()
    # (fork 0 may have finished while the abort waited)
    assert got[1][-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in got[1]) < 200
    engine.check_invariants()

def test_same_seed_same_output_different_seed_differs(engine):
    params = {"max_new_tokens": 12, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    a = engine.generate("seeded sampling", params)
    b = engine.generate("seeded sampling", params)
    c = engine.generate("seeded sampling", {**params, "seed": 99})
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


def test_second_identical_prompt_reports_cached_tokens(engine):
    prompt = "model serve request worker gateway radix tree memory batch stream route " * 3
    params = {"max_new_tokens": 2, "temperature": 0}
    first = engine.generate(prompt, params)["meta_info"]
    second = engine.generate(prompt, params)["meta_info"]
    assert first["cached_tokens"] < first["prompt_tokens"] - 1
    assert second["cached_tokens"] == second["prompt_tokens"] - 1


def test_max_and_min_new_tokens(engine):
    out = engine.generate("hello", {"max_new_tokens": 7, "min_new_tokens": 7})
    assert out["meta_info"]["completion_tokens"] == 7
    assert out["meta_info"]["finish_reason"] == "length"


def test_stop_token_ids_end_generation(engine):
    free = engine.generate("stop here", {"max_new_tokens": 6, "temperature": 0,
                                         "ignore_eos": True})
    token = free["output_ids"][2]
    out = engine.generate("stop here", {"max_new_tokens": 6, "temperature": 0,
                                        "ignore_eos": True, "stop_token_ids": [token]})
    assert out["output_ids"] == free["output_ids"][:free["output_ids"].index(token) + 1]
    assert out["meta_info"]["finish_reason"] == "stop"
    assert out["meta_info"]["matched_stop"] == token


def test_a_matched_stop_token_or_eos_leaves_its_text_out_unless_kept(engine):
    # As in vLLM and SGLang, the token that ended the output stays in output_ids but its text
    # is not in the text ("no_stop_trim" keeps it); its text (" on", "</s>") was appended.
    base = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    free = engine.generate("stop here", base)
    token = free["output_ids"][2]
    before = engine.generate("stop here", {**base, "max_new_tokens": 2})["text"]
    upto = engine.generate("stop here", {**base, "max_new_tokens": 3})["text"]
    assert upto != before
    stopped = {**base, "stop_token_ids": [token]}
    out = engine.generate("stop here", stopped)
    assert out["text"] == before and out["output_ids"][-1] == token
    assert out["meta_info"]["completion_tokens"] == 3
    assert engine.generate("stop here", {**stopped, "no_stop_trim": True})["text"] == upto

    async def streamed(params: dict) -> str:
        return "".join([c.text async for c in engine.stream("stop here", sampling_params=params)])

    assert asyncio.run(streamed(stopped)) == before
    eos = engine.tokenizer.eos_token_id
    shown = {"max_new_tokens": 6, "temperature": 0, "skip_special_tokens": False,
             "min_new_tokens": 2, "logit_bias": {str(eos): 100}}
    out = engine.generate("stop here", shown)
    assert out["output_ids"][-1] == eos and out["meta_info"]["matched_stop"] == eos
    assert out["text"] == before and asyncio.run(streamed(shown)) == before
    kept = engine.generate("stop here", {**shown, "no_stop_trim": True})["text"]
    assert kept == before + engine.tokenizer.decode([eos], skip_special_tokens=False)


def test_no_stop_trim_keeps_a_matched_stop_string(engine):
    base = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    text = engine.generate("stop strings here", base)["text"]
    stop = text.strip()[1:3]
    cut = text.index(stop)
    assert engine.generate("stop strings here", {**base, "stop": [stop]})["text"] == text[:cut]
    kept = engine.generate("stop strings here", {**base, "stop": [stop], "no_stop_trim": True})
    assert kept["text"] == text[:cut + len(stop)]
    assert kept["meta_info"]["matched_stop"] == stop


@pytest.mark.parametrize("params, field", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"bogus": 1}, "bogus"),
    ({"max_new_tokens": "ten"}, "max_new_tokens"),
    ({"logit_bias": {"5000": 1}}, "logit_bias"),
    ({"no_stop_trim": 1}, "no_stop_trim"),
])
def test_bad_sampling_params_name_the_field_and_engine_keeps_serving(engine, params, field):
    with pytest.raises(ValueError, match=field):
        engine.generate("hello", params)
    assert engine.generate("still serving", {"max_new_tokens": 1})["meta_info"][
        "completion_tokens"] == 1


def test_prompt_over_context_length_is_refused(engine):
    too_long = [5] * engine.info.context_length
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=too_long, sampling_params={"max_new_tokens": 1})
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate(input_ids=[1, -3], sampling_params={})
    with pytest.raises(ValueError, match="empty"):
        engine.generate("", {})


def test_stream_abort_frees_kv_and_keeps_invariants(engine):
    async def partial() -> int:
        seen = 0
        async for chunk in engine.stream("abort me midway", {"max_new_tokens": 500,
                                                            "ignore_eos": True}):
            seen += len(chunk.token_ids)
            if seen >= 3:
                break
        return seen

    assert asyncio.run(partial()) >= 3
    deadline = time.monotonic() + 10
    while engine.stats().running and time.monotonic() < deadline:  # no other request needed
        time.sleep(0.05)
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0
    assert stats.kv_used_tokens == stats.radix_cache_tokens, "the aborted request's KV is freed"
    engine.check_invariants()


def test_streamed_text_equals_generated_text(engine):
    params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}

    async def collect() -> tuple[str, list[int]]:
        text, ids = [], []
        async for chunk in engine.stream("東京 café 🚀 stream", params):
            text.append(chunk.text)
            ids += chunk.token_ids
        return "".join(text), ids

    text, ids = asyncio.run(collect())
    full = engine.generate("東京 café 🚀 stream", params)
    assert ids == full["output_ids"]
    assert text == full["text"] == engine.tokenizer.decode(ids)


def test_events_probe_and_snapshot_agree_with_the_cache(engine):
    prompt_ids = [1, *range(200, 264)]  # 65 tokens: four whole 16-token blocks get cached
    engine.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 1})
    assert engine.probe(prompt_ids) >= 64
    assert engine.probe([1, 999, 998]) <= 1
    seq, blocks = engine.kv_snapshot()
    from radixpool.protocol.kv_blocks import prefix_block_hashes

    assert set(prefix_block_hashes(prompt_ids, engine.info.kv_block_size).tolist()) <= set(blocks)
    replayed: set[int] = set()
    for event in engine.kv_events.events_since(0):
        if event.seq > seq:
            break
        if event.type == "stored":
            replayed |= set(event.blocks)
        elif event.type == "removed":
            replayed -= set(event.blocks)
        elif event.type == "cleared":
            replayed.clear()
    assert replayed == set(blocks)   # `queued` events name blocks, they do not store them


def test_a_queued_request_is_announced_before_its_prefill_stores_it(engine):
    """Several gateways follow one worker: a `queued` event tells them where a prompt went a
    step after it arrived, where the `stored` event comes only once its prefill ends."""
    prompt_ids = [1, *range(400, 450)]   # 51 tokens: three whole 16-token blocks
    since = engine.kv_events.last_seq
    engine.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 1})
    from radixpool.protocol.kv_blocks import prefix_block_hashes

    hashes = tuple(prefix_block_hashes(prompt_ids, engine.info.kv_block_size).tolist())
    assert len(hashes) == 3
    events = engine.kv_events.events_since(since)
    queued = [e for e in events if e.type == "queued"]
    assert [e.blocks for e in queued] == [hashes]
    stored = [e.seq for e in events if e.type == "stored" and set(e.blocks) & set(hashes)]
    assert stored and queued[0].seq < min(stored)
    assert set(hashes) <= set(engine.kv_snapshot()[1])


def test_flush_empties_cache_and_changes_instance_id(engine):
    prompt_ids = [1, *range(300, 340)]
    engine.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 1})
    before = engine.instance_id
    engine.flush_cache()
    assert engine.instance_id != before
    assert engine.probe(prompt_ids) == 0
    assert engine.stats().radix_cache_tokens == 0
    assert engine.kv_events.events_since(0)[-1].type == "cleared"


def _in_thread(fn, timeout_s: float):
    """`fn()`'s result or exception, or AssertionError if it is still blocked after
    `timeout_s` (a daemon thread, so a hang fails the test instead of wedging it)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(fn())
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert outcome, f"still blocked after {timeout_s} s"
    return outcome[0]


def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_flush_with_requests_running_and_queued_is_refused_at_once(tiny_model):
    long = {"max_new_tokens": 100, "ignore_eos": True, "temperature": 0}
    with Engine(str(tiny_model), device="cpu", kv_cache_tokens=4096,
                max_running_requests=1) as eng:
        prompts = [[1, *range(900, 910)], [1, *range(910, 920)]]
        results: dict[int, dict] = {}
        workers = [threading.Thread(target=lambda i=i: results.update(
            {i: eng.generate(input_ids=prompts[i], sampling_params=long)})) for i in range(2)]
        for w in workers:
            w.start()
        _wait_for(lambda: (eng.stats().running, eng.stats().waiting) == (1, 1))
        before = eng.instance_id
        refused = _in_thread(eng.flush_cache, 10)
        assert isinstance(refused, EngineBusy), refused
        assert "in flight" in str(refused) and "1 running, 1 waiting" in str(refused)
        assert eng.instance_id == before
        for w in workers:   # the queued request still runs: nothing was paused
            w.join(300)
        assert [results[i]["meta_info"]["completion_tokens"] for i in range(2)] == [100, 100]
        eng.flush_cache()   # idle: flushes as before
        assert eng.instance_id != before and eng.stats().radix_cache_tokens == 0


def test_a_rid_in_flight_is_refused_and_the_first_request_keeps_its_tokens(engine):
    prompt, other = [1, *range(600, 612)], [1, *range(620, 632)]
    params = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0}
    expected = engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]

    async def scenario() -> list[int]:
        first = engine.stream(input_ids=prompt, sampling_params=params, rid="dup")
        tokens = list((await first.__anext__()).token_ids)
        with pytest.raises(RidInUse, match="'dup'"):
            await asyncio.wait_for(engine.generate_async(
                input_ids=other, sampling_params=params, rid="dup"), 10)
        with pytest.raises(ValueError, match="'dup'"):   # whatever n the newcomer asks for
            await asyncio.wait_for(engine.generate_async(
                input_ids=other, sampling_params={**params, "n": 2}, rid="dup"), 10)
        async for chunk in first:
            tokens += chunk.token_ids
        return tokens

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == expected
    again = asyncio.run(engine.generate_async(input_ids=prompt, sampling_params=params, rid="dup"))
    assert again["output_ids"] == expected   # a finished request's rid may be reused
    engine.check_invariants()


def test_a_rid_reused_right_after_a_stop_string_gets_its_own_tokens(engine):
    # A stop string ends a request here while the core still runs it (the abort is on its
    # way): the same rid, reused at once, got the old request's abort and tokens, and the core
    # leaked the KV of the request it could no longer tell apart.
    prompt = [1, *range(640, 660)]
    params = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0}
    expected = engine.generate(input_ids=prompt, sampling_params=params)
    stop = expected["text"][2:6]
    assert stop and stop in expected["text"]

    async def scenario() -> list[dict]:
        answers = []
        for trial in range(8):
            first = await engine.generate_async(
                input_ids=prompt, rid=f"again-{trial}",
                sampling_params={**params, "max_new_tokens": 200, "stop": [stop]})
            assert first["meta_info"]["finish_reason"] == "stop"
            answers.append(await engine.generate_async(
                input_ids=prompt, rid=f"again-{trial}", sampling_params=params))
        return answers

    for again in asyncio.run(asyncio.wait_for(scenario(), 120)):
        assert again["meta_info"]["finish_reason"] == "length"
        assert again["output_ids"] == expected["output_ids"]
    deadline = time.monotonic() + 30
    while engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.check_invariants()   # no slot leaked (the engine runs with debug invariants)


def test_a_rid_is_free_again_as_soon_as_its_request_is_aborted(engine):
    # A client that disconnects and retries at once with the same rid got RidInUse until the
    # core had acknowledged the abort (a step later), though its request was already gone.
    prompt = [1, *range(662, 680)]
    params = {"max_new_tokens": 300, "ignore_eos": True, "temperature": 0}
    short = {**params, "max_new_tokens": 12}
    expected = engine.generate(input_ids=prompt, sampling_params=short)["output_ids"]

    async def scenario() -> list[dict]:
        answers = []
        for trial in range(5):
            stream = engine.stream(input_ids=prompt, sampling_params=params, rid=f"gone-{trial}")
            await stream.__anext__()
            await stream.aclose()   # what a disconnect does: the request is aborted
            answers.append(await engine.generate_async(
                input_ids=prompt, sampling_params=short, rid=f"gone-{trial}"))
        return answers

    for again in asyncio.run(asyncio.wait_for(scenario(), 120)):
        assert again["meta_info"]["finish_reason"] == "length"
        assert again["output_ids"] == expected
    deadline = time.monotonic() + 30
    while engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.check_invariants()


def test_min_new_tokens_holds_back_stop_strings(engine):
    base = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}

    async def per_token_text() -> list[str]:
        return [chunk.text async for chunk in engine.stream("hello world", base)]

    texts = asyncio.run(per_token_text())   # one chunk per token on this path
    free = "".join(texts)
    stop = free.lstrip()[:1] or free[:1]    # a character that occurs at once
    early = engine.generate("hello world", {**base, "stop": [stop]})
    assert early["meta_info"]["completion_tokens"] < 10   # the stop would end it at once

    held = engine.generate("hello world", {**base, "stop": [stop], "min_new_tokens": 10})
    n = held["meta_info"]["completion_tokens"]
    assert n >= 10
    assert free.startswith(held["text"])
    if held["meta_info"]["finish_reason"] == "stop":
        assert held["meta_info"]["matched_stop"] == stop
        assert free.startswith(held["text"] + stop)
        # the stop completed in the text of the 10th token or later, not before
        assert len(held["text"]) + len(stop) > len("".join(texts[:9]))
    else:
        assert n == 30 and held["text"] == free


def test_sentencepiece_completions_keep_their_leading_space(tiny_model_factory):
    """On a Llama-2/Mistral-style tokenizer the completion is the decode of prompt + output
    minus the prompt's text: its leading space (the metaspace of its first token) is kept."""
    model = tiny_model_factory("mistral", 0, "sentencepiece")
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with Engine(str(model), device="cpu", kv_cache_tokens=2048) as eng:
        tok = eng.tokenizer
        spaced = 0
        for prompt in ("The cache", "model serve request", "east west"):
            out = eng.generate(prompt, params)
            ids = tok.encode(prompt)
            expected = tok.decode(ids + out["output_ids"])[len(tok.decode(ids)):]
            assert out["text"] == expected
            spaced += expected.startswith(" ")

            async def streamed(prompt=prompt) -> str:
                return "".join([c.text async for c in eng.stream(prompt, params)])

            assert asyncio.run(streamed()) == expected
        assert spaced, "no completion started with a word: the check above saw no leading space"


def test_a_request_whose_output_fails_to_decode_ends_alone(engine, monkeypatch):
    # An exception turning one request's tokens into output (detokenizing, stop strings) ended
    # the loop that reads the core: the rest of that step's output was lost, and every request
    # in flight then, and after, waited forever.
    from radixpool.worker.request_output import RequestOutput

    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    expected = engine.generate("a request that finishes", greedy)["output_ids"]
    apply = RequestOutput.apply

    def apply_or_fail(self, delta):
        if self.rid == "doomed" and len(self.output_ids) >= 2:
            raise ValueError("simulated decoding failure")
        return apply(self, delta)

    monkeypatch.setattr(RequestOutput, "apply", apply_or_fail)

    async def both() -> list:
        return await asyncio.wait_for(asyncio.gather(
            engine.generate_async("another request", greedy, rid="doomed"),
            engine.generate_async("a request that finishes", greedy, rid="other"),
            return_exceptions=True), 60)

    doomed, other = asyncio.run(both())   # before: a TimeoutError, both waiting for good
    results = {"doomed": doomed,
               "other": other if isinstance(other, BaseException) else other["output_ids"]}
    assert isinstance(results["doomed"], RequestFault), results["doomed"]
    assert "simulated decoding failure" in str(results["doomed"])
    # a 500 whose code keeps it out of a gateway's breaker: that request's failure alone
    assert results["doomed"].code == "output_decode_failed"
    assert results["other"] == expected
    monkeypatch.undo()
    assert engine.generate("a request that finishes", greedy)["output_ids"] == expected
