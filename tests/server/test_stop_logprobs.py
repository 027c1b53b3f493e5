"""Logprobs of an output a stop string cut, through the `openai` SDK against a real worker: the
entries cover exactly the returned text, streamed or not, for each of n choices.

The stop strings are drawn (fixed seeds) from the tiny model's own greedy outputs, so they occur:
some begin inside a token, some at a token's start. The entries listed the stop string's tokens
(and any after it), so chat entries spelled more than the message, and a completion's `tokens` ran
past its text and its `text_offset` pointed past the text's end.
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.slow

PROMPTS = ("the garden and the river", "a winter market", "stream me a story", "one two")
GREEDY = {"max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}


def token_starts(text: str, token_bytes: list[bytes]) -> list[tuple[int, str]]:
    """(where it starts in `text`, its text) of each whole-character token of the output."""
    starts = []
    for k, raw in enumerate(token_bytes):
        before = b"".join(token_bytes[:k]).decode(errors="replace")
        try:
            own = raw.decode()
        except UnicodeDecodeError:
            continue
        if own and text.startswith(before + own):
            starts.append((len(before), own))
    return starts


def draw_stops(text: str, token_bytes: list[bytes], seed: int) -> list[str]:
    """Two stop strings that begin inside a token of `text`, one that begins at a token's start."""
    rng = random.Random(seed)
    starts = token_starts(text, token_bytes)
    inside = [at + i for at, own in starts for i in range(1, len(own))]
    edges = [at for at, _ in starts]
    stops = []
    for at in [*rng.sample(inside, 2), rng.choice(edges)]:
        stop = text[at:at + rng.randint(1, 5)]
        stops.append(stop[:stop.index("\ufffd")] if "\ufffd" in stop else stop)
    assert all(stops), (text, stops)
    return stops


def expected_text(text: str, stop: str, keep: bool) -> str:
    at = text.index(stop)
    return text[:at + len(stop)] if keep else text[:at]


def spelled_bytes(token: str) -> bytes:
    """A completion token's bytes: `bytes:\\xf0\\x9f` spells bytes that are no whole character."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
    return token.encode()


def chat_entries(choice) -> list[tuple]:
    return [(e.token, bytes(e.bytes), e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
            for e in choice.logprobs.content]


def assert_chat_covers(text: str, entries: list[tuple], reference: list[tuple]) -> bool:
    """Whether the last entry is a token the cut went through."""
    assert b"".join(raw for _, raw, _, _ in entries).decode(errors="replace") == text
    assert len(entries) <= len(reference)
    for k, ((_, raw, logprob, top), (_, ref_raw, ref_logprob, ref_top)) in enumerate(
            zip(entries, reference, strict=False)):
        # the last token may straddle the cut: it keeps the part of its bytes in the text
        assert raw == ref_raw or (k == len(entries) - 1 and raw and ref_raw.startswith(raw))
        assert logprob == pytest.approx(ref_logprob, abs=1e-3)
        assert [t for t, _ in top] == [t for t, _ in ref_top]
    return bool(entries) and entries[-1][1] != reference[len(entries) - 1][1]


def assert_completion_covers(text: str, lp, reference) -> bool:
    """Whether the last entry is a token the cut went through."""
    tokens, offsets = lp.tokens, lp.text_offset
    assert len(tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(offsets)
    assert len(tokens) <= len(reference.tokens)
    assert all(0 <= at < len(text) for at in offsets), (offsets, len(text))
    assert offsets == sorted(offsets)
    joined = b"".join(spelled_bytes(token) for token in tokens)
    assert joined.decode(errors="replace") == text
    for k, (token, at, ref) in enumerate(zip(tokens, offsets, reference.tokens, strict=False)):
        assert token == ref or (k == len(tokens) - 1 and token
                                and spelled_bytes(ref).startswith(spelled_bytes(token)))
        if not token.startswith("bytes:"):
            assert text.startswith(token, at), (token, at, text)
    assert lp.token_logprobs == pytest.approx(reference.token_logprobs[:len(tokens)], abs=1e-3)
    return bool(tokens) and tokens[-1] != reference.tokens[len(tokens) - 1]


@pytest.mark.parametrize("seed", range(2))
def test_chat_logprobs_cover_the_text_a_stop_string_cut(client, seed):
    prompt = PROMPTS[seed]
    messages = [{"role": "user", "content": prompt}]
    kw = {"model": "tiny", "messages": messages, "logprobs": True, "top_logprobs": 2, **GREEDY}
    free = client.chat.completions.create(**kw).choices[0]
    text, reference = free.message.content, chat_entries(free)
    straddled = 0
    for stop in draw_stops(text, [raw for _, raw, _, _ in reference], seed):
        for n, keep in ((1, False), (2, True)):
            body = {**kw, "n": n, "stop": [stop],
                    "extra_body": {**GREEDY["extra_body"], "include_stop_str_in_output": keep}}
            whole = client.chat.completions.create(**body)
            streamed: dict[int, tuple[str, list]] = {i: ("", []) for i in range(n)}
            for chunk in client.chat.completions.create(stream=True, **body):
                for c in chunk.choices:
                    said, listed = streamed[c.index]
                    streamed[c.index] = (said + (c.delta.content or ""),
                                         listed + (chat_entries(c) if c.logprobs else []))
            for choice in whole.choices:
                said = choice.message.content
                assert said == expected_text(text, stop, keep), stop
                assert choice.finish_reason == "stop"
                entries = chat_entries(choice)
                straddled += assert_chat_covers(said, entries, reference)
                streamed_text, streamed_entries = streamed[choice.index]
                assert streamed_text == said
                assert [(e[0], e[1], [t for t, _ in e[3]]) for e in streamed_entries] == [
                    (e[0], e[1], [t for t, _ in e[3]]) for e in entries], stop
                assert [e[2] for e in streamed_entries] == pytest.approx(
                    [e[2] for e in entries], abs=1e-4)
    assert straddled, "no stop string began inside a token"


@pytest.mark.parametrize("seed", range(2, 4))
def test_completion_logprobs_cover_the_text_a_stop_string_cut(client, seed):
    kw = {"model": "tiny", "prompt": PROMPTS[seed], "logprobs": 2, **GREEDY}
    free = client.completions.create(**kw).choices[0]
    text, reference = free.text, free.logprobs
    straddled = 0
    for stop in draw_stops(text, [spelled_bytes(t) for t in reference.tokens], seed):
        for n, keep in ((1, False), (2, True)):
            body = {**kw, "n": n, "stop": [stop],
                    "extra_body": {**GREEDY["extra_body"], "include_stop_str_in_output": keep}}
            whole = client.completions.create(**body)
            streamed: dict[int, dict[str, list]] = {
                i: {"text": [], "tokens": [], "token_logprobs": [], "top_logprobs": [],
                    "text_offset": []} for i in range(n)}
            for chunk in client.completions.create(stream=True, **body):
                for c in chunk.choices:
                    streamed[c.index]["text"].append(c.text)
                    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        streamed[c.index][name] += getattr(c.logprobs, name) if c.logprobs else []
            for choice in whole.choices:
                assert choice.text == expected_text(text, stop, keep), stop
                assert choice.finish_reason == "stop"
                straddled += assert_completion_covers(choice.text, choice.logprobs, reference)
                got = streamed[choice.index]
                assert "".join(got["text"]) == choice.text
                for name in ("tokens", "text_offset"):
                    assert got[name] == getattr(choice.logprobs, name), (stop, name)
                assert got["token_logprobs"] == pytest.approx(choice.logprobs.token_logprobs,
                                                              abs=1e-4)
                assert [sorted(t) for t in got["top_logprobs"]] == [
                    sorted(t) for t in choice.logprobs.top_logprobs]
                assert [sorted(t) for t in choice.logprobs.top_logprobs] == [
                    sorted(t) for t in reference.top_logprobs[:len(choice.logprobs.tokens)]]
    assert straddled, "no stop string began inside a token"
