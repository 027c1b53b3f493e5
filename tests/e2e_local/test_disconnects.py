"""Clients that walk away in numbers: streams closed after a few tokens and non-streamed requests
whose client times out, all at once through the gateway. Every request is aborted on its worker
(the workers go idle long before the tokens asked for could have been made, and hold no KV slot
outside the radix cache), the gateway holds nothing for them and counts each as a 499, and the
next requests are served as usual."""

from __future__ import annotations

import threading
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .fleet_probes import MODEL, eventually, long_text, scrape

pytestmark = pytest.mark.slow

STREAMS = 50
IMPATIENT = 20   # non-streamed requests whose client gives up after CLIENT_TIMEOUT_S
CLIENT_TIMEOUT_S = 0.5
MAX_TOKENS = 1000  # with ignore_eos: minutes of decoding if nothing were aborted


def _gateway_answers(gateway_url: str) -> dict[str, float]:
    """`radixpool_gateway_requests_total` summed over workers, by status code."""
    text = httpx.get(gateway_url + "/metrics", timeout=10).text
    by_code: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "radixpool_gateway_requests_total":
                by_code[s.labels["code"]] = by_code.get(s.labels["code"], 0) + s.value
    return by_code


def _stream_then_leave(sdk: openai.OpenAI, errors: list, seed: int) -> None:
    try:
        with sdk.chat.completions.with_streaming_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"{seed} {uuid.uuid4().hex}"}],
                max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True}) as response:
            for i, _ in enumerate(response.parse()):
                if i == 3:
                    break
    except Exception as exc:
        errors.append(exc)


def _ask_then_give_up(sdk: openai.OpenAI, errors: list, seed: int) -> None:
    try:
        sdk.with_options(timeout=CLIENT_TIMEOUT_S).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_text(seed, 400)}],
            max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
        errors.append("answered before its client gave up")
    except openai.APITimeoutError:
        pass
    except Exception as exc:
        errors.append(exc)


def test_fifty_clients_leaving_at_once_are_aborted_everywhere(fleet, sdk):
    before = _gateway_answers(fleet.gateway.url)
    errors: list = []
    threads = [threading.Thread(target=_stream_then_leave, args=(sdk, errors, i))
               for i in range(STREAMS)]
    threads += [threading.Thread(target=_ask_then_give_up, args=(sdk, errors, 500 + i))
                for i in range(IMPATIENT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert errors == [], errors[:3]

    def idle(url: str) -> bool:
        m = scrape(url)
        return m["radixpool_num_requests_running"] == m["radixpool_num_requests_waiting"] == 0

    for url in fleet.worker_urls:
        eventually(lambda url=url: idle(url), f"{url} aborts what its clients left", 20)
        m = scrape(url)
        used = round(m["radixpool_kv_cache_usage_ratio"] * m["radixpool_kv_cache_capacity_tokens"])
        assert used == m["radixpool_radix_cache_tokens"], f"{url}: KV slots held by no request"
    assert all(w.healthy() for w in fleet.workers)  # --debug-invariants found nothing wrong
    eventually(lambda: scrape(fleet.gateway.url)["radixpool_gateway_inflight_requests"] == 0,
               "the gateway holds nothing for the clients that left", 10)

    after = _gateway_answers(fleet.gateway.url)
    new = {code: n - before.get(code, 0) for code, n in after.items() if n > before.get(code, 0)}
    assert new == {"499": STREAMS + IMPATIENT}, new  # each counted once, as a client that left

    reply = sdk.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                        messages=[{"role": "user", "content": "and now?"}],
                                        extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
