"""Pure pieces of the server: flags, error mapping, hit-rate window, lifecycle. No processes."""

from __future__ import annotations

import asyncio
import json
import math
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from radixpool.cli import build_parser
from radixpool.protocol.metrics import WORKER_METRICS
from radixpool.worker.server.config import config_from_args
from radixpool.worker.server.errors import field_path, validation_error
from radixpool.worker.server.lifecycle import Lifecycle, Phase
from radixpool.worker.server.logprobs import (
    TextCover,
    TokenEntry,
    TokenText,
    completion_logprobs,
)
from radixpool.worker.server.metrics import HitRateWindow
from radixpool.worker.server.native_api import _meta
from radixpool.worker.server.nonfinite_watch import NonfiniteWatch
from radixpool.worker.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixpool.worker.server.sse import sse

ISSUE_FLAGS = ("--model", "--served-model-name", "--host", "--port", "--device", "--dtype",
               "--kv-cache-tokens", "--mem-fraction", "--page-size", "--max-running-requests",
               "--chunked-prefill-size", "--schedule-policy", "--api-key", "--log-level",
               "--drain-timeout")


def worker_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["worker"]


def test_every_flag_has_help():
    parser = worker_parser()
    flags = {opt: action for action in parser._actions for opt in action.option_strings}
    for flag in ISSUE_FLAGS:
        assert flag in flags, flag
    for action in parser._actions:
        assert action.help, action.option_strings


def test_worker_help_is_torch_free():
    code = ("import sys; from radixpool.cli import build_parser; build_parser(); "
            "assert 'torch' not in sys.modules and 'fastapi' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_flags_become_a_validated_config(tmp_path):
    model = tmp_path / "qwen"
    model.mkdir()
    args = build_parser().parse_args(["worker", "--model", str(model), "--page-size", "16",
                                      "--kv-cache-tokens", "4096", "--schedule-policy", "fcfs"])
    config = config_from_args(args)
    assert config.served_model_name == "qwen"
    assert config.engine.page_size == 16 and config.engine.kv_cache_tokens == 4096
    assert config.engine.schedule_policy == "fcfs"
    bad = build_parser().parse_args(["worker", "--model", str(model), "--page-size", "3"])
    with pytest.raises(ValueError, match="--page-size"):
        config_from_args(bad)
    missing = build_parser().parse_args(["worker", "--model", str(tmp_path / "nope")])
    with pytest.raises(ValueError, match=r"--model .* is not a directory"):
        config_from_args(missing)
    assert config.engine.startup_timeout_s == 900
    slow = build_parser().parse_args(["worker", "--model", str(model), "--startup-timeout", "3600"])
    assert config_from_args(slow).engine.startup_timeout_s == 3600
    edge = build_parser().parse_args(["worker", "--model", str(model),
                                      "--header-read-timeout", "2.5", "--max-header-bytes", "8192",
                                      "--body-read-timeout", "7"])
    limits = config_from_args(edge).edge
    assert (limits.header_read_timeout, limits.max_header_bytes) == (2.5, 8192)
    assert limits.body_read_timeout == 7
    for flag, value in (("--header-read-timeout", "0"), ("--max-header-bytes", "10"),
                        ("--body-read-timeout", "-1")):
        bad = build_parser().parse_args(["worker", "--model", str(model), flag, value])
        with pytest.raises(ValueError, match=flag):
            config_from_args(bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--model", "m", "--kv-cache-tokens", "1",
                                   "--mem-fraction", "0.5"])
    # a KV pool of less than one page was refused only after the model had loaded
    tiny = build_parser().parse_args(["worker", "--model", str(model), "--page-size", "16",
                                      "--kv-cache-tokens", "8"])
    with pytest.raises(ValueError, match=r"--kv-cache-tokens must be at least one KV page"):
        config_from_args(tiny)
    for flag in ("--watchdog-timeout", "--grammar-compile-timeout", "--startup-timeout"):
        bad = build_parser().parse_args(["worker", "--model", str(model), flag, "0"])
        with pytest.raises(ValueError, match=f"^{flag} must be"):   # not {flag}-s, no such flag
            config_from_args(bad)
    cpu = build_parser().parse_args(["worker", "--model", str(model), "--device", "cpu",
                                     "--mem-fraction", "0.5"])
    with pytest.raises(ValueError, match=r"--mem-fraction sizes the KV cache from free GPU"):
        config_from_args(cpu)


def test_a_long_prefill_chunk_raises_the_step_budget_unless_one_is_given(tmp_path):
    """The operator's chunkedPrefillSize passes --chunked-prefill-size alone: above the default
    step budget (8192) every worker pod exited at start, since a step must hold a chunk."""
    model = tmp_path / "m"
    model.mkdir()

    def engine(*flags: str):
        return config_from_args(build_parser().parse_args(
            ["worker", "--model", str(model), *flags])).engine

    assert engine().max_prefill_tokens == 8192
    assert engine("--chunked-prefill-size", "16384").max_prefill_tokens == 16384
    assert engine("--chunked-prefill-size", "512").max_prefill_tokens == 8192
    assert engine("--chunked-prefill-size", "512",
                  "--max-prefill-tokens", "1024").max_prefill_tokens == 1024
    with pytest.raises(ValueError, match="--max-prefill-tokens"):
        engine("--chunked-prefill-size", "16384", "--max-prefill-tokens", "8192")


def test_field_paths():
    assert field_path(("body", "messages", 0, "content")) == "messages[0].content"
    assert field_path(("body",)) is None
    assert field_path(("query", "since")) == "since"


def as_api_error(model, body):
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    return validation_error(RequestValidationError(errors))


@pytest.mark.parametrize(("model", "body", "param", "words"), [
    (CompletionRequest, {"prompt": 5}, "prompt", "token ids"),
    (CompletionRequest, {"prompt": "x", "temperature": 9}, "temperature", "less than"),
    (CompletionRequest, {"prompt": "x", "typo": 1}, "typo", "unrecognized"),
    (CompletionRequest, {}, "prompt", "required"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "text"),
    (ChatCompletionRequest, {"messages": [{"role": "user"}], "tools": [{}]}, "tools[0].type",
     "required"),
    (ChatCompletionRequest, {"messages": [{"role": "user"}], "functions": [{}]}, "functions",
     "not supported"),
    # a list past its limit was told it had the wrong form ("expected ... a list of non-empty
    # strings") when it was one
    (CompletionRequest, {"prompt": "x", "stop": ["ab"] * 17}, "stop", "at most 16"),
])
def test_validation_errors_name_the_field(model, body, param, words):
    err = as_api_error(model, body)
    assert err.status == 400 and err.param == param
    assert words in err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def entries(spell: TokenText, ids: list[int]) -> list[TokenEntry]:
    return [TokenEntry(i, *spell(i), 0.0, (), True) for i in ids]


@pytest.mark.parametrize("tokenizer", ["bpe", "sentencepiece"])
def test_logprob_tokens_spell_their_own_bytes(tiny_model_factory, tokenizer):
    """Byte-level BPE and byte-fallback tokens: each token's bytes are its own, so they join to
    the text; a token inside a character reads `bytes:\\x..`; a SentencePiece token keeps the
    space its `▁` stands for; offsets count characters across chunks."""
    from radixpool.tokenization import PromptTokenizer

    words = PromptTokenizer.from_dir(tiny_model_factory("mistral", 0, tokenizer))
    spell = TokenText(words)
    text = " 東京🎉 café 👩\u200d👧 ok"
    ids = words.encode(text, add_special_tokens=False)
    spelled = [spell(i) for i in ids]
    assert b"".join(raw for _, raw in spelled) == text.encode()
    assert any(token.startswith("bytes:\\x") for token, _ in spelled)
    assert all(token == raw.decode() for token, raw in spelled if not token.startswith("bytes:"))
    first, offset = completion_logprobs(spell, entries(spell, ids[:3]))
    rest, _ = completion_logprobs(spell, entries(spell, ids[3:]), offset)
    offsets = first["text_offset"] + rest["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] == len(text) - 1
    tokens = first["tokens"] + rest["tokens"]
    assert all(text.startswith(token, at) for token, at in zip(tokens, offsets, strict=True)
               if not token.startswith("bytes:"))


def test_text_offset_of_a_token_after_a_character_that_never_completes(tiny_model):
    """A lone lead byte followed by a token that cannot continue it reads as U+FFFD: the next
    token starts after that character, not at it (it was given the broken character's offset)."""
    from radixpool.tokenization import PromptTokenizer

    words = PromptTokenizer.from_dir(tiny_model)
    spell = TokenText(words)
    lead = next(i for i in range(words.tokenizer.get_vocab_size()) if spell(i)[1] == b"\xdb")
    ids = [lead, *words.encode("15 ok", add_special_tokens=False),
           lead, lead, *words.encode(" é", add_special_tokens=False)]
    text = words.decode(ids)
    assert text == "\ufffd15 ok\ufffd\ufffd é"
    whole, _ = completion_logprobs(spell, entries(spell, ids))
    offset = None
    pieces = []
    for k in range(len(ids)):   # streamed one token a chunk: the same offsets
        piece, offset = completion_logprobs(spell, entries(spell, ids[k:k + 1]), offset)
        pieces += piece["text_offset"]
    assert pieces == whole["text_offset"]
    spelled = list(zip(whole["tokens"], whole["text_offset"], strict=True))
    assert [at for token, at in spelled if token.startswith("bytes:")] == [0, 6, 7]
    assert all(text.startswith(token, at) for token, at in spelled
               if not token.startswith("bytes:"))


def test_logprob_entries_cover_a_cut_text_however_it_was_streamed(tiny_model):
    """A stop string may cut the text anywhere, and a stream hands text out late (held while it
    may begin a stop string, or inside a character): the entries handed out cover exactly the
    text, the token the cut goes through cut to its bytes in the text, streamed or not."""
    from radixpool.tokenization import PromptTokenizer

    words = PromptTokenizer.from_dir(tiny_model)
    spell = TokenText(words)
    lead = next(i for i in range(words.tokenizer.get_vocab_size()) if spell(i)[1] == b"\xdb")
    ids = [*words.encode(" 東京🎉 café", add_special_tokens=False), lead,
           *words.encode("15 ok", add_special_tokens=False)]
    text = words.decode(ids)
    logprobs = [-float(k) for k in range(len(ids))]
    for cut in range(len(text) + 1):
        said = text[:cut]
        whole = TextCover(spell).take(ids, logprobs, None, said, frozenset(), end=True, cut=True)
        assert b"".join(e.raw for e in whole).decode(errors="replace") == said
        assert [e.logprob for e in whole] == logprobs[:len(whole)]
        assert all(e.raw == spell(e.token_id)[1] for e in whole[:-1])
        for seed in range(3):
            rng, cover, streamed, sent, k = random.Random(seed), TextCover(spell), [], 0, 0
            while k < len(ids):
                step = rng.randint(1, 3)
                ready = words.decode(ids[:k + step]).rstrip("\ufffd")
                assert text.startswith(ready)
                upto = max(sent, min(cut, len(ready) - rng.randint(0, 3)))
                streamed += cover.take(ids[k:k + step], logprobs[k:k + step], None,
                                       text[sent:upto], frozenset())
                sent, k = upto, k + step
            streamed += cover.take([], [], None, said[sent:], frozenset(), end=True, cut=True)
            assert streamed == whole, (cut, seed)


def test_generate_logprobs_of_tokens_with_no_mass_are_valid_json():
    """A token the model gave no mass has logprob -inf: /generate clamps it to -9999.0 as the
    OpenAI endpoints do (JSON has no -inf: Starlette refused the body with a 500, and a stream
    wrote `-Infinity`, which parsers reject)."""
    fork = SimpleNamespace(prompt_tokens=3, completion_tokens=2, cached_tokens=0,
                           finish_reason="length", matched_stop=None,
                           logprobs=[-0.5, -math.inf], top_logprobs=[[(4, -0.5), (9, -math.inf)],
                                                                     [(7, -math.inf)]])
    meta = _meta(fork, "r1", True)
    assert meta["logprobs"] == [-0.5, -9999.0]
    assert meta["top_logprobs"] == [[[4, -0.5], [9, -9999.0]], [[7, -9999.0]]]
    frame = sse({"meta_info": meta})
    assert json.loads(frame[len(b"data: "):], parse_constant=pytest.fail)["meta_info"] == meta
    with pytest.raises(ValueError):   # a non-finite number never goes out as invalid JSON
        sse({"logprob": math.nan})


def test_hit_rate_window_forgets_old_requests():
    window = HitRateWindow(size=2)
    assert window.rate == 0.0
    window.add(100, 0)
    window.add(100, 50)
    assert window.rate == 0.25
    window.add(100, 100)
    assert window.rate == 0.75


def test_lifecycle_drain_waits_for_inflight():
    async def scenario():
        life = Lifecycle()
        assert life.phase is Phase.LOADING and not life.serving
        life.mark_ready()
        life.request_started()
        assert life.begin_drain() and not life.begin_drain()
        assert not life.serving
        assert not await life.wait_idle(0.01)
        life.request_finished()
        assert await life.wait_idle(0.01)

    asyncio.run(scenario())


def test_docs_list_every_worker_metric():
    doc = (Path(__file__).parents[2] / "docs" / "worker.md").read_text()
    for spec in WORKER_METRICS:
        assert f"`{spec.series[0] if spec.kind == 'info' else spec.name}" in doc, spec.name


class _FakeEngine:
    alive = True


def test_livez_fails_only_once_the_engine_is_gone_for_good(tmp_path):
    """Liveness (what the operator's probe asks) stays 200 while loading and draining, so a slow
    load or a drain is never killed, and turns 503 once the core is dead."""
    import httpx

    from radixpool.worker.server.app import create_app
    from radixpool.worker.server.state import WorkerState

    (tmp_path / "m").mkdir()
    state = WorkerState(config_from_args(build_parser().parse_args(
        ["worker", "--model", str(tmp_path / "m"), "--api-key", "k"])))
    engine = _FakeEngine()

    async def scenario() -> list[tuple[int, int]]:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as http:
            async def probe() -> tuple[int, int]:
                return (await http.get("/livez")).status_code, \
                    (await http.get("/health")).status_code
            seen = [await probe()]                  # loading
            state.engine = engine
            state.lifecycle.mark_ready()
            seen.append(await probe())              # ready
            state.lifecycle.begin_drain()
            seen.append(await probe())              # draining
            engine.alive = False
            seen.append(await probe())              # the core died, not yet noticed
            state.lifecycle.mark_failed("the engine core process died (exit code -9)")
            seen.append(await probe())              # noticed: exiting
            failed = await http.get("/livez")
            assert "exit code -9" in failed.json()["message"]
            refused = await http.get("/v1/models", headers={"Authorization": "Bearer k"})
            assert refused.status_code == 503 and "died" in refused.json()["error"]["message"]
            return seen

    assert asyncio.run(scenario()) == [(200, 503), (200, 200), (200, 503), (503, 503),
                                       (503, 503)]


class _StreamingEngine:
    """Streams one token per request, then waits for an abort: the requests of an engine."""

    alive = True

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def stream(self, input_ids, sampling_params, namespace, rid):
        from radixpool.worker.request_output import StreamChunk

        async def chunks():
            yield StreamChunk(rid, 0, "a", [5], prompt_tokens=len(input_ids))
            yield StreamChunk(rid, 0, "", [], finished=True, finish_reason="length",
                              completion_tokens=1)
        return chunks()

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def test_a_drain_aborts_a_request_whose_rid_a_closing_one_had_too(tmp_path):
    """The engine frees a finished request's rid before its handler has read the last chunk; a
    newcomer taking the rid then was not counted as holding it (the first still did), and lost
    it when the first closed: a drain's abort_all left it running."""
    from radixpool.worker.sampling_params import SamplingParams
    from radixpool.worker.server.generation import EngineRun
    from radixpool.worker.server.state import WorkerState

    (tmp_path / "m").mkdir()
    state = WorkerState(config_from_args(build_parser().parse_args(
        ["worker", "--model", str(tmp_path / "m")])))
    state.engine = engine = _StreamingEngine()

    async def scenario() -> None:
        first = EngineRun(state, [1, 2], SamplingParams(), None, "r")
        await first.first()   # the engine has finished it; its handler has yet to read that
        second = EngineRun(state, [1, 2], SamplingParams(), None, "r")
        await second.first()
        await first.close()
        assert state.abort_all() == 1 and engine.aborted == ["r"]
        await second.close()
        assert state.abort_all() == 0

    asyncio.run(scenario())


def test_a_request_refused_after_its_first_tokens_is_a_400_naming_the_field(tmp_path):
    """The engine may end a request with an error after its first tokens (its grammar library
    failed on it): a non-streamed answer was then a 500, though the README promises a 400
    naming the constraint."""
    from radixpool.worker.request_output import StreamChunk
    from radixpool.worker.sampling_params import SamplingParams
    from radixpool.worker.server.errors import APIError
    from radixpool.worker.server.generation import EngineRun
    from radixpool.worker.server.openai_api import CHAT_RENAMES
    from radixpool.worker.server.state import WorkerState

    class FailingGrammar(_StreamingEngine):
        def stream(self, input_ids, sampling_params, namespace, rid):
            async def chunks():
                yield StreamChunk(rid, 0, "{", [5], prompt_tokens=len(input_ids))
                raise ValueError("json_schema could not be followed: the grammar library "
                                 "failed on it (RuntimeError: boom)")
            return chunks()

    (tmp_path / "m").mkdir()
    state = WorkerState(config_from_args(build_parser().parse_args(
        ["worker", "--model", str(tmp_path / "m")])))
    state.engine = FailingGrammar()

    async def scenario() -> APIError:
        run = EngineRun(state, [1, 2], SamplingParams(), None, "g", CHAT_RENAMES, "messages")
        await run.first()
        with pytest.raises(APIError) as refused:
            await run.collect()
        assert not state.active_rids
        return refused.value

    err = asyncio.run(scenario())
    assert err.status == 400 and err.param == "response_format"
    assert err.message.startswith("response_format could not be followed")


class _FailingMidStream(_StreamingEngine):
    """Streams one token, then fails as `failure` says: the engine refusing the request (a
    grammar that cannot go on: ValueError) or failing itself (RuntimeError)."""

    def __init__(self, failure: Exception) -> None:
        super().__init__()
        self.failure = failure
        self.info = type("Info", (), {"context_length": 4096, "vocab_size": 100,
                                       "sampling_defaults": {}})()
        self.tokenizer = type("Tokenizer", (), {"longest_token_chars": 16})()

    def stream(self, input_ids, sampling_params, namespace, rid):
        from radixpool.worker.request_output import StreamChunk

        async def chunks():
            yield StreamChunk(rid, 0, "{", [5], prompt_tokens=len(input_ids))
            raise self.failure
        return chunks()


@pytest.mark.parametrize(("failure", "kind"), [
    (ValueError("json_schema could not be followed"), "invalid_request_error"),
    (RuntimeError("CUDA error: an illegal memory access"), "server_error"),
])
def test_a_stream_that_fails_mid_way_says_whose_fault_it_was(tmp_path, failure, kind):
    """Every mid-stream failure was labelled `server_error`, so a gateway could not tell a
    request its grammar refused (the client's) from a worker failing (which should trip its
    breaker)."""
    import httpx

    from radixpool.worker.server.app import create_app
    from radixpool.worker.server.state import WorkerState

    (tmp_path / "m").mkdir()
    state = WorkerState(config_from_args(build_parser().parse_args(
        ["worker", "--model", str(tmp_path / "m")])))
    state.engine = _FailingMidStream(failure)
    state.lifecycle.mark_ready()

    async def stream() -> list[str]:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as http:
            r = await http.post("/generate", json={"input_ids": [1, 2], "stream": True})
            assert r.status_code == 200
            return [line for line in r.text.splitlines() if line]

    events = asyncio.run(stream())
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert events[-1] == "data: [DONE]" and error["type"] == kind
    assert str(failure) in error["message"]


def test_large_legal_bodies_pass_the_member_bound():
    from radixpool.json_members import MAX_OBJECT_MEMBERS
    from radixpool.worker.server.fast_path import validated
    from radixpool.worker.server.native_api import GenerateBody
    from radixpool.worker.server.openai_protocol import CompletionRequest

    colons = " ".join(f"w{i}:" for i in range(MAX_OBJECT_MEMBERS + 1))   # counted, not refused
    completion = validated(CompletionRequest, json.dumps({
        "prompt": colons, "logit_bias": {str(t): -1.0 for t in range(120_000)}}).encode())
    assert len(completion.logit_bias) == 120_000
    generate = validated(GenerateBody, json.dumps({"input_ids": list(range(100_000))}).encode())
    assert len(generate.input_ids) == 100_000


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), [
    ("/generate", {"input_ids": [[1]] * 1025}, 400, "input_ids", "too_many_choices"),
    ("/generate", {"input_ids": [1] * 4096}, 400, "input_ids", "context_length_exceeded"),
    ("/generate", {"input_ids": [[1], [1] * 4096]}, 400, "input_ids[1]",
     "context_length_exceeded"),
    ("/generate", {"input_ids": [[1], [99_999] + [1] * 4096]}, 400, "input_ids[1]", None),
    ("/generate", {"input_ids": [[1], [1]], "sampling_params": [{"n": 1}, {"n": 1024}]}, 400,
     "sampling_params[1].n", "too_many_choices"),
    ("/v1/completions", {"prompt": [[1]] * 1025}, 400, "prompt", "too_many_choices"),
    ("/v1/completions", {"model": "other", "prompt": [[1]] * 1025}, 404, "model",
     "model_not_found"),
    ("/v1/completions", {"prompt": [1] * 4096}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [1] * 100, "max_tokens": 4000}, 400, "max_tokens",
     "context_length_exceeded"),
])
def test_a_body_the_worker_would_refuse_for_its_size_is_refused_by_its_validation(
        path, body, status, param, code):
    """A body over 256 KiB is validated in a child process, and what comes back is unpickled
    on the event loop: 2M one-id prompts came back as 2M lists (a 2.5 s stall), a 16M-id prompt
    as 16M ints (0.45 s), only to be refused by the handler. Validation for a worker now makes
    those refusals itself, with the handler's error (the same cases through HTTP:
    test_bad_input.py)."""
    from radixpool.worker.server.errors import APIError
    from radixpool.worker.server.fast_path import validated
    from radixpool.worker.server.native_api import GenerateBody
    from radixpool.worker.server.openai_protocol import CompletionRequest
    from radixpool.worker.server.request_checks import Served

    model = GenerateBody if path == "/generate" else CompletionRequest
    served = Served("tiny", "/models/tiny", vocab_size=1000, context_length=2048)
    with pytest.raises(APIError) as refused:
        validated(model, json.dumps(body).encode(), served)
    assert (refused.value.status, refused.value.param, refused.value.code) == (status, param, code)


def test_a_long_text_is_tokenized_with_the_gil_released(tiny_model):
    """The worker tokenizes a long prompt on a thread beside its event loop, but the tokenizer's
    `encode` held the GIL for the whole call: a 2 MB chat stood the loop still for 2 s. Here a
    thread ticks while a long text is tokenized; it used to tick once or not at all."""
    from radixpool.tokenization import PromptTokenizer

    words = PromptTokenizer.from_dir(tiny_model)
    text = "hello world, " * 100_000
    ticks = 0
    encoding = threading.Event()

    def tick() -> None:
        nonlocal ticks
        encoding.wait()
        while encoding.is_set():
            ticks += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    encoding.set()
    ids = words.encode(text, add_special_tokens=False)
    encoding.clear()
    during = ticks
    ticker.join()
    assert ids == words.tokenizer.encode(text, add_special_tokens=False).ids
    assert during >= 10, f"another thread ran {during} times while the text was tokenized"


def _watch_runs(watch: NonfiniteWatch, outcomes: list[tuple[bool, bool]]) -> None:
    async def run() -> None:
        for nonfinite, produced in outcomes:
            watch.finished(nonfinite, produced)
            await asyncio.sleep(0)   # a probe started meanwhile runs
        for _ in range(10):
            await asyncio.sleep(0)
    asyncio.run(run())


def test_the_nonfinite_watch_probes_the_model_after_a_run_of_faults_only(caplog):
    verdicts: list[bool | Exception] = []

    async def probe() -> bool:
        verdict = verdicts.pop(0)
        if isinstance(verdict, Exception):
            raise verdict
        return verdict

    watch = NonfiniteWatch(3, probe)
    _watch_runs(watch, [(True, False), (True, False), (False, True), (True, False),
                        (False, False), (True, False)])   # a refusal resets nothing
    assert (watch.probes, watch.broken) == (0, False)
    verdicts[:] = [True]   # the next fault makes three: the model is fine, the prompts are not
    _watch_runs(watch, [(True, False)])
    assert (watch.probes, watch.broken, watch.run) == (1, False, 0)
    verdicts[:] = [RuntimeError("the engine is stopping")]   # no verdict: the next one probes
    _watch_runs(watch, [(True, False)] * 3)
    assert (watch.probes, watch.broken) == (2, False)
    verdicts[:] = [False]
    with caplog.at_level("ERROR", logger="radixpool.worker.server"):
        _watch_runs(watch, [(True, False)] * 5 + [(False, True)])   # broken for good
    assert (watch.probes, watch.broken) == (3, True)
    assert len([r for r in caplog.records if "model is broken" in r.getMessage()]) == 1
    off = NonfiniteWatch(0, probe)
    _watch_runs(off, [(True, False)] * 100)
    assert (off.probes, off.broken) == (0, False)


def test_a_long_requests_latency_lands_in_a_finite_bucket_above_it():
    """A 20-minute generation (which the gateway lets run for 30) must not read as the top
    bucket's bound: the buckets once stopped at 120 s, pinning every long p99 to 2 minutes."""
    from prometheus_client.parser import text_string_to_metric_families

    from radixpool.worker.server.metrics import WorkerMetrics

    metrics = WorkerMetrics("m", "v", engine_fn=lambda: None, stats_fn=lambda: None)
    metrics.record_first_token(400.0, 390.0)
    metrics.record_finished("stop", 10, 0, 5, 1200.0)
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    for name, seconds in (("radixpool_e2e_request_latency_seconds", 1200.0),
                          ("radixpool_time_to_first_token_seconds", 400.0),
                          ("radixpool_queue_time_seconds", 390.0)):
        le = next(s.labels["le"] for s in families[name].samples
                  if s.name.endswith("_bucket") and s.value)
        assert le != "+Inf" and float(le) >= seconds, (name, le)


def test_every_finish_reason_is_exported_at_zero_before_its_first_request():
    """rate() needs an earlier sample: a worker's first aborted request, its series born at 1,
    never showed on the boards' "Finished requests / s" (nor did the first `length`)."""
    from prometheus_client.parser import text_string_to_metric_families

    from radixpool.worker.server.metrics import WorkerMetrics

    metrics = WorkerMetrics("m", "v", engine_fn=lambda: None, stats_fn=lambda: None)
    samples = {s.labels["finish_reason"]: s.value
               for f in text_string_to_metric_families(metrics.exposition().decode())
               for s in f.samples if s.name == "radixpool_requests_total"}
    assert samples == {"stop": 0.0, "length": 0.0, "abort": 0.0}


def test_fields_a_request_leaves_out_take_the_models_generation_config(tmp_path, tiny_model):
    """As in vLLM and SGLang: Qwen3's generation_config.json asks for temperature 0.6, top_p
    0.95, top_k 20; a request without them sampled at OpenAI's temperature 1 and no top-k."""
    import httpx

    from radixpool.tokenization import PromptTokenizer
    from radixpool.worker.server.app import create_app
    from radixpool.worker.server.state import WorkerState

    class Recording(_StreamingEngine):
        def __init__(self) -> None:
            super().__init__()
            self.params = []
            self.info = type("Info", (), {"context_length": 4096, "vocab_size": 100,
                                          "sampling_defaults": {"temperature": 0.6,
                                                                "top_p": 0.95, "top_k": 20}})()
            self.tokenizer = PromptTokenizer.from_dir(tiny_model)

        def stream(self, input_ids, sampling_params, namespace, rid):
            self.params.append(sampling_params)
            return super().stream(input_ids, sampling_params, namespace, rid)

    (tmp_path / "m").mkdir()
    state = WorkerState(config_from_args(build_parser().parse_args(
        ["worker", "--model", str(tmp_path / "m")])))
    state.engine = engine = Recording()
    state.lifecycle.mark_ready()

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as http:
            for path, body in (("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1}),
                               ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1,
                                                    "temperature": 0.2, "top_p": 0}),
                               ("/generate", {"input_ids": [1, 2, 3]}),
                               ("/generate", {"input_ids": [1, 2, 3],
                                              "sampling_params": {"top_k": -1}})):
                assert (await http.post(path, json=body)).status_code == 200

    asyncio.run(scenario())
    assert [(p.temperature, p.top_p, p.top_k) for p in engine.params] == [
        (0.6, 0.95, 20), (0.2, 0.95, 1), (0.6, 0.95, 20), (0.6, 0.95, -1)]


class _FakeRun:
    """An `EngineRun` as `start_all` sees it: its first token comes when `gate` opens, or it
    is refused at once with `error`."""

    def __init__(self, index: int, started: list[int], gate: asyncio.Event,
                 error: Exception | None = None) -> None:
        self.index, self.started, self.gate, self.error = index, started, gate, error
        self.finished = self.closed = False

    async def first(self) -> None:
        self.started.append(self.index)
        if self.error is not None:
            raise self.error
        await self.gate.wait()

    async def close(self) -> None:
        self.closed = True


class _StayingClient:
    async def receive(self) -> dict:
        await asyncio.Event().wait()   # never leaves
        return {}


def test_a_batch_sends_every_prompt_to_the_engine_at_once():
    # Each prompt of a batch (/generate and /v1/completions take lists) went to the engine
    # only once the one before it had its first token, so the engine never batched them: a
    # batch of 64 short prompts took 64 prefill steps instead of one.
    from radixpool.worker.server.generation import start_all

    async def main() -> None:
        started: list[int] = []
        gate = asyncio.Event()
        runs = [_FakeRun(i, started, gate) for i in range(4)]
        batch = asyncio.ensure_future(start_all(_StayingClient(), runs))
        for _ in range(10):
            await asyncio.sleep(0)
        assert started == [0, 1, 2, 3] and not batch.done()   # all sent, none answered yet
        gate.set()
        await batch
        assert not any(run.closed for run in runs)
        # one refused: the others are closed (aborted) and the refusal is raised at once
        started.clear()
        gate = asyncio.Event()
        refused = ValueError("bad prompt")
        runs = [_FakeRun(i, started, gate, refused if i == 2 else None) for i in range(4)]
        with pytest.raises(ValueError, match="bad prompt"):
            await asyncio.wait_for(start_all(_StayingClient(), runs), 5)
        assert all(run.closed for run in runs)

    asyncio.run(main())
