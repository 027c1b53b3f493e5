"""Faults a real fleet lives through, seen from an `openai` SDK client of the gateway: a worker
killed mid-run, a worker restarted on its port, a worker flushed, the gateway restarted.
Each test leaves the fleet whole (every worker up, the gateway routing to all)."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

import openai
import pytest

from .fleet_probes import MODEL, eventually, gateway_view, long_text, server_info

pytestmark = pytest.mark.slow

JOIN_TIMEOUT_S = 120  # a hung request fails the test instead of hanging the suite


@dataclass
class StreamOutcome:
    worker: str | None = None
    first_token: threading.Event = None
    tokens: int = 0
    finish_reason: str | None = None
    error: BaseException | None = None


def _long_stream(sdk: openai.OpenAI, outcome: StreamOutcome, max_tokens: int) -> None:
    try:
        with sdk.chat.completions.with_streaming_response.create(
                model=MODEL, messages=[{"role": "user", "content": uuid.uuid4().hex}],
                max_tokens=max_tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True}) as response:
            outcome.worker = response.headers["x-radixpool-worker"]
            for chunk in response.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    outcome.tokens += 1
                    outcome.first_token.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    outcome.finish_reason = chunk.choices[0].finish_reason
    except Exception as exc:
        outcome.error = exc
    finally:
        outcome.first_token.set()


def _streams_flowing(sdk: openai.OpenAI, count: int, max_tokens: int
                     ) -> tuple[list[StreamOutcome], list[threading.Thread]]:
    """`count` long streams in threads, returned once each has its first token."""
    streams = [StreamOutcome(first_token=threading.Event()) for _ in range(count)]
    threads = [threading.Thread(target=_long_stream, args=(sdk, s, max_tokens)) for s in streams]
    for t in threads:
        t.start()
    for s in streams:
        assert s.first_token.wait(60)
    return streams, threads


def _ask(sdk: openai.OpenAI, prompt: str, max_tokens: int = 2):
    return sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0)


def test_a_worker_killed_mid_run(fleet, sdk):
    streams, threads = _streams_flowing(sdk, 6, 1900)
    assert all(s.error is None and s.worker for s in streams), [s.error for s in streams]

    # Non-streamed requests still being computed when the worker dies have sent no byte yet:
    # the gateway retries them elsewhere, as it does new requests it routes there before
    # noticing the worker is gone.
    answers: list[object] = []

    def ask_many(k: int) -> None:
        for i in range(3):
            try:
                raw = _ask(sdk, f"after the crash {k} {i} {uuid.uuid4().hex}", 40)
                answers.append(raw.headers["x-radixpool-worker"])
            except Exception as exc:
                answers.append(exc)

    askers = [threading.Thread(target=ask_many, args=(k,)) for k in range(6)]
    for t in askers:
        t.start()
    # The worker whose stream is furthest from done: hundreds of tokens still to come.
    victim_url = min((s for s in streams if s.finish_reason is None),
                     key=lambda s: s.tokens).worker
    cut = [s for s in streams if s.worker == victim_url and s.finish_reason is None]
    fleet.kill_worker(fleet.worker_urls.index(victim_url))
    for t in [*threads, *askers]:
        t.join(JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in [*threads, *askers]), "a request hung"

    errors = [a for a in answers if isinstance(a, Exception)]
    assert errors == [] and len(answers) == 18
    assert victim_url not in answers[-6:]  # by then the gateway has stopped routing there
    for s in cut:  # cut short, and the client is told why (not a silent short answer)
        assert isinstance(s.error, openai.APIError) and s.finish_reason is None, \
            (s.error, s.tokens, s.finish_reason)
        assert "failed mid-stream" in str(s.error), repr(s.error)
    for s in streams:
        if s.worker != victim_url:
            assert s.error is None and s.finish_reason == "length", s.error

    fleet.restart_worker(fleet.worker_urls.index(victim_url))
    fleet.wait_gateway_routes_to_all()


def test_a_worker_restarted_on_its_port_gets_a_fresh_tree(fleet, sdk):
    prompt = long_text(100)
    owner = _ask(sdk, prompt).headers["x-radixpool-worker"]
    assert _ask(sdk, prompt + " again").parse().usage.prompt_tokens_details.cached_tokens > 180
    index = fleet.worker_urls.index(owner)
    before = gateway_view(fleet.gateway.url)[owner]
    assert before["tree_blocks"] > 0

    fleet.restart_worker(index)
    new_id = server_info(owner)["instance_id"]
    assert new_id != before["instance_id"]
    eventually(lambda: gateway_view(fleet.gateway.url)[owner]["instance_id"] == new_id,
               "the gateway sees the new instance")
    after = gateway_view(fleet.gateway.url)[owner]
    assert after["tree_corrections"].get("instance_id", 0) > \
        before["tree_corrections"].get("instance_id", 0)
    fleet.wait_gateway_routes_to_all()

    def fleet_tokens(field: str) -> int:
        return sum(w[field] for w in gateway_view(fleet.gateway.url).values())

    prompt_tokens = fleet_tokens("prompt_tokens")
    predicted = fleet_tokens("predicted_cached_tokens")
    cold = _ask(sdk, prompt + " once more").parse().usage
    assert cold.prompt_tokens_details.cached_tokens < 20
    eventually(lambda: fleet_tokens("prompt_tokens") == prompt_tokens + cold.prompt_tokens,
               "the gateway recorded the answer")
    assert fleet_tokens("predicted_cached_tokens") == predicted  # no false hit
    warm = _ask(sdk, prompt + " and again")
    assert warm.parse().usage.prompt_tokens_details.cached_tokens > 180


def test_a_flushed_worker_is_forgotten_then_refilled(fleet, sdk):
    prompt = long_text(200)
    owner = _ask(sdk, prompt).headers["x-radixpool-worker"]
    before = gateway_view(fleet.gateway.url)[owner]
    new_id = fleet.flush_worker(fleet.worker_urls.index(owner))
    eventually(lambda: gateway_view(fleet.gateway.url)[owner]["instance_id"] == new_id,
               "the gateway sees the flush")
    assert gateway_view(fleet.gateway.url)[owner]["tree_blocks"] == 0
    assert gateway_view(fleet.gateway.url)[owner]["tree_corrections"].get("instance_id", 0) > \
        before["tree_corrections"].get("instance_id", 0)
    assert _ask(sdk, prompt + " again").parse().usage.prompt_tokens_details.cached_tokens < 20
    assert _ask(sdk, prompt + " more").parse().usage.prompt_tokens_details.cached_tokens > 180


def test_gateway_restart_costs_only_clean_refusals_while_it_is_down(fleet, sdk):
    outcomes: list[tuple[float, float, object]] = []  # (sent, done, worker url or exception)
    stop = threading.Event()

    def client() -> None:
        quick = sdk.with_options(timeout=30)
        while not stop.is_set():
            sent = time.monotonic()
            try:
                result: object = _ask(quick, f"steady {uuid.uuid4().hex}").headers[
                    "x-radixpool-worker"]
            except Exception as exc:
                result = exc
            outcomes.append((sent, time.monotonic(), result))
            time.sleep(0.05)

    thread = threading.Thread(target=client)
    thread.start()
    try:
        eventually(lambda: len(outcomes) >= 3, "requests flow before the restart")
        down_from = time.monotonic()
        fleet.restart_gateway(down_s=1.0)
        up_from = time.monotonic()
        eventually(lambda: sum(1 for s, _, _ in outcomes if s > up_from) >= 3,
                   "requests flow after the restart")
    finally:
        stop.set()
        thread.join(JOIN_TIMEOUT_S)
    failures = [(s, d, r) for s, d, r in outcomes if isinstance(r, Exception)]
    assert failures, "the client never noticed the gateway was down"
    for sent, done, error in failures:  # while it stops: a 503 `draining`; then no connection
        assert isinstance(error, openai.APIConnectionError) or (
            isinstance(error, openai.APIStatusError) and error.status_code == 503
            and error.code == "draining"), repr(error)
        # a request sent just before the stop can reach the gateway after its SIGTERM
        assert sent <= up_from and done >= down_from, (
            sent - down_from, done - down_from, up_from - down_from, repr(error),
            repr(error.__cause__), repr(error.__cause__ and error.__cause__.__cause__))
    assert all(not isinstance(r, Exception) for s, _, r in outcomes if s > up_from)
