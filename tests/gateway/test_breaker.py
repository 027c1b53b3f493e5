"""The circuit breaker: the state machine driven directly (and by hypothesis), and through a real
gateway where a half-open probe answered 503 used to exclude a healthy worker for good."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.simfleet import SimConfig
from radixpool.gateway.breaker import FAILURE_KINDS, CircuitBreaker
from radixpool.gateway.stream_errors import error_event
from tests.gateway.conftest import words
from tests.gateway.test_upstream_faults import wait_for

FAILURES, OPEN_S = 3, 10.0


def test_breaker_opens_probes_once_half_open_and_closes_on_success():
    b = CircuitBreaker(failures=2, open_seconds=10)
    b.record_failure("server_error", now=0)
    assert b.allows(1)
    b.record_failure("connect_error", now=1)
    assert b.state(1) == "open" and not b.allows(5)
    assert b.allows(11) and b.state(11) == "half_open"
    b.dispatched(11)
    assert not b.allows(11.5)            # one probe at a time
    b.record_failure("timeout", now=12)  # the probe timed out: open again
    assert b.state(12) == "open" and not b.allows(13)
    assert b.allows(22)
    b.dispatched(22)
    b.record_success(now=22)
    assert b.state(22) == "closed" and b.allows(22)
    assert b.failures_by_kind == {"server_error": 1, "connect_error": 1, "timeout": 1}


def test_every_half_open_outcome_resolves_it():
    for outcome in ("success", *FAILURE_KINDS):
        b = CircuitBreaker(failures=1, open_seconds=1)
        b.record_failure("server_error", now=0)
        b.dispatched(1)
        if outcome == "success":
            b.record_success(1.5)
        else:
            b.record_failure(outcome, 1.5)
        assert b.state(1.5) == ("closed" if outcome == "success" else "open"), outcome


def test_a_probe_whose_outcome_never_comes_frees_its_slot():
    b = CircuitBreaker(failures=1, open_seconds=1)
    b.record_failure("server_error", now=0)
    b.dispatched(1)                      # the probe's client left; nothing is ever recorded
    assert not b.allows(1.5)
    assert b.allows(2.0) and b.state(2.0) == "half_open"


outcomes = st.one_of(
    st.tuples(st.just("tick"), st.floats(0, 2 * OPEN_S)),
    st.tuples(st.just("dispatch"), st.none()),
    st.tuples(st.just("success"), st.none()),
    st.tuples(st.just("failure"), st.sampled_from(FAILURE_KINDS)),
)


def drive(b: CircuitBreaker, steps: list[tuple[str, object]]) -> float:
    now = 0.0
    for op, arg in steps:
        if op == "tick":
            now += arg
        elif op == "dispatch":
            if b.allows(now):
                b.dispatched(now)
        elif op == "success":
            b.record_success(now)
        else:
            b.record_failure(arg, now)
    return now


@settings(max_examples=300, deadline=None)
@given(st.lists(outcomes, max_size=40))
def test_from_any_history_the_breaker_lets_a_probe_through_after_the_cool_down(steps):
    b = CircuitBreaker(FAILURES, OPEN_S)
    now = drive(b, steps)
    assert b.allows(now + OPEN_S)         # never stuck: open or half-open, a probe goes
    state = b.state(now + OPEN_S)
    assert state in ("closed", "half_open")
    if state == "half_open":
        b.dispatched(now + OPEN_S)
        assert not b.allows(now + OPEN_S)  # exactly one probe at a time
        b.record_success(now + OPEN_S)
        assert b.state(now + OPEN_S) == "closed"


@settings(max_examples=300, deadline=None)
@given(st.lists(outcomes, max_size=40), st.sampled_from(FAILURE_KINDS))
def test_from_any_history_consecutive_failures_open_it_until_the_cool_down(steps, kind):
    b = CircuitBreaker(FAILURES, OPEN_S)
    now = drive(b, steps)
    if b.state(now) == "open":
        now += OPEN_S                      # let it reach half-open first
    for _ in range(FAILURES):
        b.record_failure(kind, now)
    assert b.state(now) == "open" and not b.allows(now)
    assert not b.allows(now + OPEN_S * 0.99)
    assert b.allows(now + OPEN_S) and b.state(now + OPEN_S) == "half_open"


@settings(max_examples=300, deadline=None)
@given(st.lists(outcomes, max_size=40))
def test_from_any_history_a_blocking_breaker_says_when_it_lets_requests_through(steps):
    # late binding sets its timer there: it must find the worker open to requests, not spin
    b = CircuitBreaker(FAILURES, OPEN_S)
    now = drive(b, steps)
    until = b.blocked_until(now)
    assert (until is None) == b.allows(now)
    if until is not None:
        assert now < until <= now + OPEN_S
        assert not b.allows(until - OPEN_S * 0.01)
        assert b.allows(until) and b.blocked_until(until) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(outcomes, max_size=40), st.sampled_from(("success", *FAILURE_KINDS)))
def test_from_any_history_a_half_open_outcome_resolves_the_state(steps, outcome):
    b = CircuitBreaker(FAILURES, OPEN_S)
    now = drive(b, steps)
    if b.state(now) != "half_open":
        return
    if outcome == "success":
        b.record_success(now)
    else:
        b.record_failure(outcome, now)
    assert b.state(now) == ("closed" if outcome == "success" else "open")


def test_a_probe_answered_503_does_not_exclude_a_recovered_worker_for_good(make_stack):
    stack = make_stack(2, policy="round_robin", max_retries=1, breaker_failures=1,
                       breaker_open_seconds=0.3)
    a, b = stack.fleet.urls
    for url in (a, b):
        stack.client.post(url + "/sim/fail", json={"requests": True})
    # the first worker's 503 is retried on the second, whose 503 is the answer: a breaker opens
    assert stack.client.post("/generate", json={"text": "w1"}).status_code == 503
    states = [w["circuit_breaker"] for w in stack.client.get("/workers").json()["workers"]]
    bad = [a, b][max(i for i, state in enumerate(states) if state == "open")]
    good = b if bad == a else a
    stack.client.post(good + "/sim/fail", json={})
    stack.check_all()
    time.sleep(0.35)
    # half-open: round robin sends a probe to `bad` within two requests; it answers 503 and the
    # request is retried on `good`
    for i in range(4):
        assert stack.client.post("/generate", json={"text": words(i, 4)}).status_code == 200
    stack.client.post(bad + "/sim/fail", json={})   # it recovers; its /health was 200 throughout
    deadline = time.monotonic() + 5
    served_by_bad = 0
    while time.monotonic() < deadline and not served_by_bad:
        stack.check_all()
        time.sleep(0.1)
        for i in range(4):
            r = stack.client.post("/generate", json={"text": words(100 + i, 4)})
            assert r.status_code == 200
            served_by_bad += r.headers["x-radixpool-worker"] == bad
    assert served_by_bad, "the recovered worker never got traffic back"
    assert stack.client.get("/workers").json()["workers"][(a, b).index(bad)][
        "circuit_breaker"] == "closed"


def streamed(path: str, i: int) -> dict:
    if path == "/generate":
        return {"text": words(i, 4), "stream": True}
    return {"messages": [{"role": "user", "content": words(i, 4)}], "stream": True}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate"])
def test_a_worker_that_fails_every_stream_mid_way_is_taken_out(make_stack, path):
    """A 200 whose stream ends in the worker's own error event is a failure, not a success:
    such a worker used to keep its breaker closed and all its traffic."""
    stack = make_stack(1, breaker_failures=FAILURES, breaker_open_seconds=3600)
    stack.client.post(stack.fleet.urls[0] + "/sim/fail",
                      json={"stream_error": {"type": "server_error"}})
    for i in range(FAILURES):
        r = stack.client.post(path, json=streamed(path, i))
        assert r.status_code == 200 and "generation failed" in r.text
    stack.settle()
    worker = stack.client.get("/workers").json()["workers"][0]
    assert worker["circuit_breaker"] == "open"
    assert worker["breaker_failures"] == {"stream_error": FAILURES}
    assert stack.client.post(path, json=streamed(path, 99)).status_code == 503


def test_a_stream_the_worker_ends_with_the_clients_error_keeps_the_breaker_closed(make_stack):
    stack = make_stack(1, breaker_failures=FAILURES, breaker_open_seconds=3600)
    stack.client.post(stack.fleet.urls[0] + "/sim/fail", json={"stream_error": {
        "type": "invalid_request_error", "code": "grammar_failed"}})
    for i in range(2 * FAILURES):
        r = stack.client.post("/v1/chat/completions", json=streamed("/v1/chat/completions", i))
        assert r.status_code == 200 and "invalid_request_error" in r.text
    stack.settle()
    worker = stack.client.get("/workers").json()["workers"][0]
    assert worker["circuit_breaker"] == "closed" and worker["breaker_failures"] == {}


def test_a_request_error_neither_fails_nor_closes_the_breaker():
    """A poison prompt's 500 `nonfinite_logits` says nothing of the worker: the failure run and
    the open state stand, and a half-open probe answered so frees the slot for the next."""
    b = CircuitBreaker(failures=2, open_seconds=10)
    b.record_failure("server_error", now=0)
    for t in range(1, 20):
        b.record_request_error(now=t)
    assert b.state(20) == "closed"
    b.record_failure("server_error", now=21)    # the run of real failures went on
    assert b.state(21) == "open"
    b.record_request_error(now=22)
    assert b.state(22) == "open"                # not a success either
    b.dispatched(31)
    assert not b.allows(31)
    b.record_request_error(now=32)
    assert b.state(32) == "half_open" and b.allows(32)   # the next probe goes at once
    assert b.failures_by_kind == {"server_error": 2}


def poison(stack, error: dict, stream: bool = False) -> None:
    stack.client.post(stack.fleet.urls[0] + "/sim/fail",
                      json={"stream_error" if stream else "error": error})


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("code", ["nonfinite_logits", "output_decode_failed"])
def test_one_clients_nonfinite_requests_keep_the_breaker_closed(make_stack, path, stream, code):
    """A client that sends a prompt overflowing the model again and again gets each 500 as the
    worker gave it, counted in the metrics; the worker's breaker stays closed (it used to open
    after `--breaker-failures` of them: one client could take every worker out)."""
    stack = make_stack(1, breaker_failures=FAILURES, breaker_open_seconds=3600)
    poison(stack, {"code": code, "message": "this request failed alone"}, stream)
    for i in range(3 * FAILURES):
        body = streamed(path, i) if stream else {**streamed(path, i), "stream": False}
        r = stack.client.post(path, json=body)
        assert r.status_code == (200 if stream else 500)
        assert code in r.text and "this request failed alone" in r.text
    stack.settle()
    worker = stack.client.get("/workers").json()["workers"][0]
    assert worker["circuit_breaker"] == "closed" and worker["breaker_failures"] == {}
    metrics = stack.client.get("/metrics").text
    url = stack.fleet.urls[0]
    assert f'radixpool_gateway_requests_total{{code="500",worker="{url}"}} {3 * FAILURES}.0' \
        in metrics
    stack.client.post(stack.fleet.urls[0] + "/sim/fail", json={})
    assert stack.client.post(path, json=streamed(path, 99)).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("code", [None, "engine_failed"])
def test_other_server_errors_still_open_the_breaker(make_stack, stream, code):
    stack = make_stack(1, breaker_failures=FAILURES, breaker_open_seconds=3600)
    poison(stack, {"code": code}, stream)
    path = "/v1/chat/completions"
    for i in range(FAILURES):
        body = streamed(path, i) if stream else {**streamed(path, i), "stream": False}
        assert stack.client.post(path, json=body).status_code == (200 if stream else 500)
    stack.settle()
    worker = stack.client.get("/workers").json()["workers"][0]
    assert worker["circuit_breaker"] == "open"
    assert worker["breaker_failures"] == {"stream_error" if stream else "server_error": FAILURES}
    assert stack.client.post(path, json=streamed(path, 99)).status_code == 503


@pytest.mark.parametrize(("events", "status"), [
    (b'data: {"error":{"message":"generation failed: CUDA error","type":"server_error",'
     b'"param":null,"code":null}}\n\ndata: [DONE]\n\n', 500),
    (b'data: {"error":{"message":"generation failed: the engine core process died",'
     b'"type":"service_unavailable","param":null,"code":"engine_core_died"}}\n\n', 503),
    (b'data: {"error":{"message":"generation failed: response_format could not be followed",'
     b'"type":"invalid_request_error","param":"response_format","code":null}}\n\n', 400),
    (b'data: {"error": {"object": "error", "message": "x", "type": "BadRequestError", '
     b'"param": null, "code": 400}}\n\n', 400),                        # vLLM, SGLang
    (b'data: {"error": {"object": "error", "message": "x", "type": "InternalServerError", '
     b'"param": null, "code": 500}}\n\n', 500),
    (b'data: {"error": {"message": "x", "code": 299}}\n\n', 500),    # statuses stay 4xx/5xx
    (b'data: {"error": "engine failed"}\n\n', 500),
    (b'data: {"error": {trunc\n\n', 500),
    (b'data: {"error":{"message":"generation failed: the model produced non-finite logits",'
     b'"type":"server_error","param":null,"code":"nonfinite_logits"}}\n\n', 500),
    (b'data: {"choices":[{"delta":{"content":"{\\"error\\": 1}"}}]}\n\n', None),  # a token
    (b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\ndata: [DONE]\n\n', None),
])
def test_the_status_an_error_event_in_a_stream_stands_for(events, status):
    """A 5xx is the worker's fault (its breaker counts it), a 4xx the client's."""
    error = error_event(events)
    assert (error and error.status) == status


def test_a_late_success_of_a_request_sent_before_it_opened_leaves_the_breaker_open():
    b = CircuitBreaker(failures=2, open_seconds=10)
    b.record_failure("server_error", now=0)
    b.record_failure("server_error", now=1)
    b.record_success(now=2)   # a long stream sent at 0.5 ends well
    assert b.state(2) == "open" and not b.allows(5)
    assert b.allows(11) and b.state(11) == "half_open"   # the cool-down decides, as before


def test_a_long_stream_ending_well_does_not_reopen_a_failing_worker_to_traffic(make_stack):
    """A worker whose engine fails every new request while an older stream runs on: the breaker
    opens, and the stream's good end closed it again at once, so each stream that ended let the
    next requests' 500s through to their clients."""
    stack = make_stack(1, sim=SimConfig(decode_ms_per_token=100.0), breaker_failures=FAILURES,
                       breaker_open_seconds=3600)
    worker = stack.gateway.workers.get(stack.fleet.urls[0])
    answer: list[httpx.Response] = []
    stream = threading.Thread(target=lambda: answer.append(stack.client.post(
        "/v1/completions", json={"prompt": words(0, 8), "max_tokens": 20, "stream": True})))
    stream.start()
    assert wait_for(lambda: worker.inflight == 1, 5)
    stack.client.post(stack.fleet.urls[0] + "/sim/fail", json={"error": {}})
    for i in range(FAILURES):
        assert stack.client.post("/v1/completions", json={
            "prompt": words(100 + 10 * i, 8), "max_tokens": 1}).status_code == 500
    stream.join(10)
    assert answer and answer[0].status_code == 200 and "data: [DONE]" in answer[0].text
    stack.settle()
    assert stack.client.get("/workers").json()["workers"][0]["circuit_breaker"] == "open"
    r = stack.client.post("/v1/completions", json={"prompt": words(200, 8), "max_tokens": 1})
    assert r.status_code == 503, r.text   # not the failing worker's 500
