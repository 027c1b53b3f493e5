"""The gateway relays, it does not rewrite: greedy n=3 streams under a long shared prefix read
the same through the gateway as straight from a worker (choices, text, finish reasons, usage)."""

from __future__ import annotations

import openai
import pytest

from .fleet_probes import MODEL, long_text

pytestmark = pytest.mark.slow


def _choices(client: openai.OpenAI, question: str) -> tuple[dict, dict, tuple[int, int]]:
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(
            model=MODEL, n=3, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "system", "content": long_text(9100, 600)},
                      {"role": "user", "content": question}]):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    return texts, finishes, (usage.prompt_tokens, usage.completion_tokens)


def test_greedy_n3_streams_read_the_same_through_the_gateway_and_from_a_worker(fleet, sdk):
    questions = ("what is cached?", "and what is evicted?")
    through = [_choices(sdk, q) for q in questions]
    direct = openai.OpenAI(base_url=fleet.worker_urls[0] + "/v1", api_key="unused",
                           max_retries=0, timeout=120)
    straight = [_choices(direct, q) for q in questions]
    assert through == straight
    for texts, finishes, _ in through:
        assert sorted(texts) == sorted(finishes) == [0, 1, 2] and all(texts.values())
