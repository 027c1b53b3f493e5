"""A checkpoint that makes the model's logits NaN for some requests (here: one token's embedding
row is NaN, so a request gets NaN logits once that token is in its prompt, or once it generated
it: mid-stream, after tokens were sent): those requests end with a clear
server error, never garbage tokens nor invalid JSON, on the OpenAI endpoints (with the `openai`
SDK) and on /generate, streamed or not; requests beside them in the batch get the very tokens
they get alone, the worker keeps serving, and the metric counts each fault. The error's code,
`nonfinite_logits`, tells a gateway it is that request's alone (not a failing worker). A model
that gives *every* request NaN logits is a broken worker: after `--unhealthy-after-nonfinite`
of them in a row and a failed self-check, `/health` and `/livez` answer 503; one client
repeating a poison prompt never makes them so (the self-check is finite)."""

from __future__ import annotations

import json
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from worker_process import WorkerProcess

from radixpool.worker.config import EngineConfig
from radixpool.worker.engine_core import EngineCore
from radixpool.worker.messages import GenerateRequest
from radixpool.worker.sampling_params import SamplingParams
from radixpool.worker.server.nonfinite_watch import probe_prompt

pytestmark = pytest.mark.slow


def eventually(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)

GOOD = [[(7 * i + 3 * j) % 400 + 10 for j in range(12 + i)] for i in range(4)]
GREEDY = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}


def greedy_outputs(model, prompts: list[list[int]]) -> list[list[int]]:
    core = EngineCore(EngineConfig(str(model), device="cpu"))
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    out = {i: [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        core.add_request(GenerateRequest(str(i), prompt, params, seed=0))
    while core.has_work:
        for delta in core.step().deltas:
            out[int(delta.rid)] += delta.token_ids
    return [out[i] for i in range(len(prompts))]


def run_alone(core: EngineCore, rid: str, prompt: list[int]
              ) -> tuple[list[int], str | None, int]:
    """(tokens, error, cached prompt tokens) of one greedy request run to its end on `core`."""
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    core.add_request(GenerateRequest(rid, prompt, params, seed=0))
    tokens, error, cached = [], None, 0
    while core.has_work:
        for delta in core.step().deltas:
            tokens += delta.token_ids
            error = delta.error or error
            cached = max(cached, delta.cached_tokens)
    return tokens, error, cached


@pytest.fixture(scope="module")
def poisoned(tiny_model):
    """(poisoned token, a prompt whose greedy output reaches it at its 3rd token): a token that
    neither the GOOD prompts nor their outputs hold, and a chat message can spell."""
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    candidates = [[20 + i, 30 + 2 * i, 40 + 3 * i] for i in range(16)]
    known = GOOD + [probe_prompt(tokenizer.get_vocab_size())]   # and the worker's self-check
    outputs = greedy_outputs(tiny_model, known + candidates)
    spoken = {t for ids in known for t in ids} | {t for ids in outputs[:len(known)] for t in ids}
    for prompt, output in zip(candidates, outputs[len(known):]):
        token = output[2]
        spelled = tokenizer.encode(tokenizer.decode([token])).ids[1:] == [token]
        if token not in spoken and token not in prompt + output[:2] and spelled:
            return token, prompt
    pytest.fail("no candidate prompt reaches an unused token")


@pytest.fixture(scope="module")
def checkpoint(tiny_model, tmp_path_factory, poisoned):
    path = tmp_path_factory.mktemp("nan-checkpoint")
    shutil.copytree(tiny_model, path, dirs_exist_ok=True)
    weights = load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"][poisoned[0]] = float("nan")
    save_file(weights, path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def broken(checkpoint):
    proc = WorkerProcess(checkpoint, checkpoint / "worker.log").wait_ready()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(broken):
    return openai.OpenAI(base_url=f"{broken.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def faults(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(r"^radixpool_nonfinite_logits_total (\S+)$", text, re.M)[1])


def good_tokens(client, prompt):
    r = client.completions.create(model="tiny", prompt=prompt, logprobs=2, **GREEDY)
    return r.choices[0].text, r.choices[0].logprobs.token_logprobs


def test_openai_requests_fail_cleanly_and_their_batch_goes_on(broken, client, poisoned):
    token, mid_way = poisoned
    before = faults(broken.url)
    alone = [good_tokens(client, p) for p in GOOD]

    def bad_completion(prompt):
        with pytest.raises(openai.InternalServerError, match="non-finite logits"):
            client.completions.create(model="tiny", prompt=prompt, logprobs=2, **GREEDY)

    def bad_stream(prompt):
        chunks = []
        with pytest.raises(openai.APIError, match="non-finite logits"):
            for chunk in client.completions.create(model="tiny", prompt=prompt, stream=True,
                                                   logprobs=2, **GREEDY):
                chunks.append(chunk)
        return chunks

    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good_tokens, client, p) for p in GOOD]
        bads = [pool.submit(bad_completion, [10, 11, token, 12]),
                pool.submit(bad_stream, [10, 11, token, 12]),
                pool.submit(bad_completion, mid_way)]
        mid_stream = pool.submit(bad_stream, mid_way)
        for (text, logprobs), (text_alone, logprobs_alone) in zip([g.result() for g in goods],
                                                                  alone):
            # the same tokens; the model's batched floats may differ in the last bits
            assert text == text_alone
            assert logprobs == pytest.approx(logprobs_alone, abs=1e-4)
        for b in bads:
            b.result()
        # the tokens before the fault were sent, with finite logprobs; then the error event
        sent = mid_stream.result()
        assert sum(len(c.choices[0].logprobs.token_logprobs) for c in sent if c.choices) == 3
    assert faults(broken.url) == before + 4
    assert good_tokens(client, GOOD[0])[0] == alone[0][0]   # still serving


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_logprobs_fails_cleanly(broken, client, checkpoint, poisoned, stream):
    before = faults(broken.url)
    word = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).decode([poisoned[0]])
    with pytest.raises(openai.APIError, match="non-finite logits") as raised:
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": word}], stream=stream,
            logprobs=True, top_logprobs=2, **GREEDY)
        if stream:
            list(reply)
    assert raised.value.code == "nonfinite_logits"
    assert faults(broken.url) == before + 1
    ok = client.completions.create(model="tiny", prompt=GOOD[0], logprobs=2, **GREEDY)
    assert ok.choices[0].finish_reason == "length"   # still serving


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_of_a_poisoned_prompt_fails_as_the_models_fault(broken, client, poisoned,
                                                                      stream):
    """With n > 1 the other choices wait for the first one's prompt to be cached; when its
    logits were NaN they were cut with a plain message: the answer was a 400 blaming
    `prompt` (no `nonfinite_logits` code, so the SDK's and gateway's handling of a model
    fault did not apply) instead of the 500 a single choice gets."""
    before = faults(broken.url)
    with pytest.raises(openai.APIError, match="non-finite logits") as raised:
        reply = client.completions.create(model="tiny", prompt=[10, 11, poisoned[0], 12], n=3,
                                          stream=stream, **GREEDY)
        if stream:
            list(reply)
    assert raised.value.code == "nonfinite_logits"
    if not stream:
        assert isinstance(raised.value, openai.InternalServerError)
    assert faults(broken.url) == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_generate_fails_cleanly(broken, poisoned, stream):
    before = faults(broken.url)
    body = {"input_ids": poisoned[1], "stream": stream,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "logprobs": 2,
                                "ignore_eos": True}}
    with httpx.Client(base_url=broken.url, timeout=120) as http:
        r = http.post("/generate", json=body)
        if stream:   # three tokens went out (the poisoned one last), then an error event
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.text.splitlines()
                      if line.startswith("data: ")]
            docs = [json.loads(e) for e in events if e != "[DONE]"]   # all valid JSON
            assert sum(len(d.get("output_ids", ())) for d in docs) == 3
            assert "non-finite logits" in docs[-1]["error"]["message"]
            error = docs[-1]["error"]
        else:
            assert r.status_code == 500
            error = r.json()["error"]
            assert "non-finite logits" in error["message"]
        assert (error["type"], error["code"]) == ("server_error", "nonfinite_logits")
        ok = http.post("/generate", json={**body, "input_ids": GOOD[0]})
        assert ok.status_code == 200
    assert faults(broken.url) == before + 1


@pytest.mark.parametrize(("chunk", "page_size"), [(64, 1), (4, 1), (8, 4)])
def test_a_poisoned_prompt_leaves_no_nan_in_the_cache_for_prompts_sharing_its_prefix(
        checkpoint, poisoned, chunk, page_size):
    """Its KV went into the tree: attention spreads a NaN to the positions before it too (a
    masked column weighs 0, and 0 x NaN is NaN), so the next prompt sharing its first tokens
    reused NaN KV and failed as well; a common system prompt would fail every request after.
    With chunks of 4 or 8, the poisoned chunk was cached before the last chunk showed the NaN
    (with pages of 4 the shared page before the poisoned token's is poisoned too)."""
    shared = GOOD[0][:8] + [20, 21, 22, 23, 24]
    bad = [*shared, poisoned[0], 25, 26, *range(30, 38)]
    good = [*shared, *range(40, 52)]
    alone = greedy_outputs(checkpoint, [good])[0]
    core = EngineCore(EngineConfig(str(checkpoint), device="cpu", page_size=page_size,
                                   chunked_prefill_size=chunk, max_prefill_tokens=max(chunk, 8),
                                   debug_invariants=True))
    tokens, error, _ = run_alone(core, "bad", bad)
    assert tokens == [] and "non-finite logits" in error
    tokens, error, _ = run_alone(core, "good", good)
    assert (tokens, error) == (alone, None)
    tokens, error, cached = run_alone(core, "again", good)   # the clean KV is cached as ever
    assert (tokens, error) == (alone, None) and cached >= len(good) - page_size


def test_the_sdk_does_not_retry_a_poison_prompt(broken, poisoned):
    """The SDK retries a 500 twice by default: the prompt was computed three times and counted
    three faults towards --unhealthy-after-nonfinite. `x-should-retry: false` stops that."""
    client = openai.OpenAI(base_url=f"{broken.url}/v1", api_key="unused", max_retries=2,
                           timeout=120)
    before = faults(broken.url)
    with pytest.raises(openai.InternalServerError, match="non-finite logits") as raised:
        client.completions.create(model="tiny", prompt=[10, 11, poisoned[0], 12], **GREEDY)
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert faults(broken.url) == before + 1


def health(url: str) -> tuple[int, int]:
    return httpx.get(f"{url}/health").status_code, httpx.get(f"{url}/livez").status_code


def test_one_client_repeating_a_poison_prompt_leaves_the_worker_healthy(broken, client,
                                                                        poisoned):
    # more faults in a row than --unhealthy-after-nonfinite (8) with nothing between: the
    # worker's self-check of its model is finite, so the prompts are at fault, not the model
    bad = [10, 11, poisoned[0], 12]
    def self_checks() -> int:
        return broken.log().count("their prompts are at fault")

    for round_ in range(2):
        before = self_checks()
        good_tokens(client, GOOD[0])
        for _ in range(10):
            with pytest.raises(openai.InternalServerError, match="non-finite logits"):
                client.completions.create(model="tiny", prompt=bad, **GREEDY)
        eventually(lambda: self_checks() > before, "the self-check ran")   # noqa: B023
        assert health(broken.url) == (200, 200), round_
    assert "radixpool_nonfinite_logits_broken 0.0" in httpx.get(f"{broken.url}/metrics").text
    assert good_tokens(client, GOOD[0])


@pytest.fixture(scope="module")
def all_nan_checkpoint(tiny_model, tmp_path_factory):
    """A checkpoint whose every embedding is NaN: every request's logits are NaN."""
    path = tmp_path_factory.mktemp("all-nan-checkpoint")
    shutil.copytree(tiny_model, path, dirs_exist_ok=True)
    weights = load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"].fill_(float("nan"))
    save_file(weights, path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def all_nan(all_nan_checkpoint):
    path = all_nan_checkpoint
    proc = WorkerProcess(path, path / "worker.log", "--unhealthy-after-nonfinite", "3")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def all_nan_short(all_nan_checkpoint):
    """The all-NaN checkpoint with a 6-token context: the self-check must fit it."""
    path = all_nan_checkpoint
    proc = WorkerProcess(path, path / "short.log", "--unhealthy-after-nonfinite", "2",
                         "--context-length", "6")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_the_self_check_fits_a_tiny_context(all_nan_short):
    for i in range(2):
        r = httpx.post(f"{all_nan_short.url}/generate", json={
            "input_ids": [10 + i, 11], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 500 and r.json()["error"]["code"] == "nonfinite_logits"
    eventually(lambda: health(all_nan_short.url) == (503, 503), "the worker reports itself broken")


def test_a_worker_whose_every_request_is_nan_reports_itself_unhealthy(all_nan):
    client = openai.OpenAI(base_url=f"{all_nan.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    for i in range(3):
        assert health(all_nan.url) == (200, 200), i   # a few faults may be the prompts'
        with pytest.raises(openai.InternalServerError) as raised:
            client.completions.create(model="tiny", prompt=GOOD[i], **GREEDY)
        assert raised.value.code == "nonfinite_logits"
    # the third starts the self-check, which fails too: out of rotation, and restarted by the
    # kubelet
    eventually(lambda: health(all_nan.url) == (503, 503), "the worker reports itself broken")
    body = httpx.get(f"{all_nan.url}/health").json()
    assert body["code"] == "nonfinite_logits" and "last 3 requests" in body["message"]
    assert "radixpool_nonfinite_logits_broken 1.0" in httpx.get(f"{all_nan.url}/metrics").text
    with pytest.raises(openai.InternalServerError):   # still answering, still broken, logged once
        client.completions.create(model="tiny", prompt=GOOD[3], **GREEDY)
    assert health(all_nan.url) == (503, 503)
    assert all_nan.log().count("the model is broken on this worker") == 1
