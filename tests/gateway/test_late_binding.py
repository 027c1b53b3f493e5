"""Late binding through the real gateway on loopback: a request held while its worker is
saturated is served once the worker drains; one whose client leaves while held is removed."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
import openai
import pytest

from bench.simfleet import SimConfig
from tests.gateway.conftest import words
from tests.gateway.test_active_active import wait_until


def held_outcomes(stack) -> dict[str, float]:
    out = {}
    for line in stack.client.get("/metrics").text.splitlines():
        if line.startswith("radixpool_gateway_wait_queue_outcomes_total{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("radixpool_gateway_wait_queue_requests "):
            out["now"] = float(line.rsplit(" ", 1)[1])
    return out


def occupy(stack, loop_thread, body: dict) -> threading.Thread:
    """A slow request in the background, once the gateway counts it in flight."""
    slow = threading.Thread(target=stack.client.post, args=("/v1/chat/completions",),
                            kwargs={"json": body})
    slow.start()
    assert wait_until(loop_thread, lambda: any(w.inflight for w in stack.gateway.workers))
    return slow


def hold(stack, loop_thread, body: dict) -> tuple[threading.Thread, dict]:
    """A request in the background, once the gateway holds it; when the thread ends, its
    answer is the dict's "r"."""
    answer: dict = {}
    held = threading.Thread(target=lambda: answer.setdefault("r", stack.client.post(
        "/v1/chat/completions", json=body)))
    held.start()
    assert wait_until(loop_thread, lambda: len(stack.gateway.holding.binding.queue) == 1)
    return held, answer


def test_a_request_held_behind_a_saturated_worker_is_served_when_its_prefill_ends(
        make_stack, loop_thread):
    # one worker, prefills of 0.3 s: the second request arrives while the first is prefilling
    stack = make_stack(workers=1, sim=SimConfig(prefill_us_per_token=3000.0),
                       late_binding=True, hold_queued_tokens=0)
    assert wait_until(loop_thread, lambda: all(
        w.tree_source == "kv_events" for w in stack.gateway.workers))
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    answers = {}

    def ask(name: str, prompt: str) -> None:
        answers[name] = client.chat.completions.with_raw_response.create(
            model="sim-model", max_tokens=2, messages=[{"role": "user", "content": prompt}])

    first = threading.Thread(target=ask, args=("first", words(0, 100)))
    first.start()
    assert wait_until(loop_thread, lambda: any(w.queued(0) for w in stack.gateway.workers))
    ask("second", words(2000, 20))
    first.join(10)
    assert answers["second"].http_response.status_code == 200
    assert answers["second"].parse().choices[0].message.content
    assert answers["first"].http_response.status_code == 200
    outcomes = held_outcomes(stack)
    assert outcomes.get("placed") == 1 and outcomes["now"] == 0
    assert 'reason="late"' in stack.client.get("/metrics").text


def test_a_client_that_leaves_while_held_is_removed_and_counted(make_stack, loop_thread):
    # without KV events a request is queued until it ends: a 2 s decode holds the next one
    stack = make_stack(workers=1, sim=SimConfig(decode_ms_per_token=100.0),
                       late_binding=True, hold_queued_tokens=0, kv_events=False)
    body = {"model": "sim-model", "max_tokens": 20,
            "messages": [{"role": "user", "content": words(0, 40)}]}
    slow = occupy(stack, loop_thread, body)
    started = time.monotonic()
    try:
        httpx.post(stack.url + "/v1/chat/completions", timeout=0.3, json={
            **body, "max_tokens": 1, "messages": [{"role": "user", "content": words(500, 9)}]})
        raise AssertionError("the held request was answered before the worker drained")
    except httpx.ReadTimeout:
        pass
    assert time.monotonic() - started < 1.5
    assert wait_until(loop_thread, lambda: not stack.gateway.holding)
    outcomes = held_outcomes(stack)
    assert outcomes.get("left") == 1 and outcomes["now"] == 0 and outcomes["placed"] == 0
    assert stack.gateway.metrics.requests["gateway", "499"] == 1  # answered by no worker
    slow.join(10)
    only = stack.gateway.workers.get(stack.fleet.urls[0])
    assert wait_until(loop_thread, lambda: only.inflight == 0)
    fresh = stack.client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    assert fresh.status_code == 200 and held_outcomes(stack)["placed"] == 0


def test_a_request_held_past_its_deadline_is_sent_to_the_saturated_worker_anyway(
        make_stack, loop_thread):
    stack = make_stack(workers=1, sim=SimConfig(decode_ms_per_token=100.0), late_binding=True,
                       hold_queued_tokens=0, kv_events=False, hold_max_seconds=0.3)
    body = {"model": "sim-model", "max_tokens": 20,
            "messages": [{"role": "user", "content": words(0, 40)}]}
    slow = occupy(stack, loop_thread, body)
    started = time.monotonic()
    late = stack.client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    assert late.status_code == 200
    assert time.monotonic() - started < 1.5       # not after the slow one's 2 s
    assert held_outcomes(stack).get("overdue") == 1
    slow.join(10)


def test_a_held_request_goes_to_a_remaining_worker_when_the_others_leave(make_stack, loop_thread):
    stack = make_stack(workers=2, sim=SimConfig(decode_ms_per_token=50.0), late_binding=True,
                       hold_queued_tokens=0, kv_events=False)
    body = {"model": "sim-model", "max_tokens": 20,
            "messages": [{"role": "user", "content": words(0, 40)}]}
    busy = [threading.Thread(target=stack.client.post, args=("/v1/chat/completions",),
                             kwargs={"json": {**body, "messages": [
                                 {"role": "user", "content": words(100 * i, 40)}]}})
            for i in range(2)]
    for thread in busy:
        thread.start()
    assert wait_until(loop_thread, lambda: all(w.inflight for w in stack.gateway.workers))
    held, answer = hold(stack, loop_thread, {**body, "max_tokens": 1})
    gone = stack.fleet.urls[0]
    loop_thread.call(stack.gateway.workers.remove, gone)
    held.join(10)
    assert answer["r"].status_code == 200
    assert answer["r"].headers["x-radixpool-worker"] == stack.fleet.urls[1]
    for thread in busy:
        thread.join(10)


def test_a_held_request_goes_to_its_worker_once_that_worker_stops_draining(
        make_stack, loop_thread):
    # Before: a worker back from draining (its /health 200 again) was not offered the held
    # requests; they waited out hold_max_seconds (30 s here) although it was free.
    stack = make_stack(workers=1, sim=SimConfig(decode_ms_per_token=100.0), late_binding=True,
                       hold_queued_tokens=0, kv_events=False, hold_max_seconds=30.0)
    body = {"model": "sim-model", "max_tokens": 20,
            "messages": [{"role": "user", "content": words(0, 40)}]}
    slow = occupy(stack, loop_thread, body)
    held, answer = hold(stack, loop_thread, {**body, "max_tokens": 1})
    only, = stack.fleet.workers
    only.fail_health = True   # it starts draining: its /health answers 503
    stack.check_all()
    slow.join(10)
    assert wait_until(loop_thread, lambda: not any(w.inflight for w in stack.gateway.workers))
    assert len(stack.gateway.holding.binding.queue) == 1   # nowhere to go while it drains
    only.fail_health = False
    stack.check_all()
    held.join(10)
    assert not held.is_alive(), "still held with its worker back"
    assert answer["r"].status_code == 200
    assert held_outcomes(stack).get("placed") == 1


def test_a_client_that_leaves_as_its_held_request_is_placed_is_not_served(
        make_stack, loop_thread):
    # Before: when the client left in the same moment its request was placed (as a request
    # ahead of it ended, e.g. all at once when a stopping gateway closed its connections),
    # asyncio.wait_for (Python 3.11) swallowed the cancellation: the request went to the worker
    # for nobody and was counted as answered, while its client had got no answer.
    stack = make_stack(workers=1, sim=SimConfig(decode_ms_per_token=100.0), late_binding=True,
                       hold_queued_tokens=0, kv_events=False)
    body = {"model": "sim-model", "max_tokens": 20,
            "messages": [{"role": "user", "content": words(0, 40)}]}
    slow = occupy(stack, loop_thread, body)
    holding = stack.gateway.holding
    only = stack.gateway.workers.get(stack.fleet.urls[0])

    async def leave_as_placed() -> str:
        key = stack.gateway.keys.build("/v1/completions", {"model": "sim-model",
                                                            "prompt": words(500, 9)})
        waiting = asyncio.create_task(holding.wait(key))
        while not holding and not waiting.done():
            await asyncio.sleep(0.01)
        holding.offer(stack.gateway.clock() + holding.binding.queue.max_wait)  # placed now
        waiting.cancel()   # and its client leaves in the same moment
        try:
            await waiting
        except asyncio.CancelledError:
            return "withdrawn"
        return "sent"

    assert loop_thread.run(leave_as_placed()) == "withdrawn"
    assert only.inflight == 1   # the slow request's alone: the placement was given back
    assert held_outcomes(stack) == {"placed": 0, "overdue": 0, "left": 1, "rejected": 0,
                                    "now": 0}
    slow.join(10)
    assert wait_until(loop_thread, lambda: only.inflight == 0)


def test_requests_still_held_when_the_gateway_drain_ends_get_503_draining(
        make_stack, loop_thread):
    # Before: a stopping gateway closed the connections of the requests still held when its
    # drain ended, and the OpenAI SDK saw a connection error instead of a 503 it retries.
    stack = make_stack(workers=1, sim=SimConfig(decode_ms_per_token=100.0), late_binding=True,
                       hold_queued_tokens=0, kv_events=False, hold_max_seconds=30.0)
    body = {"model": "sim-model", "max_tokens": 60,
            "messages": [{"role": "user", "content": words(0, 40)}]}   # 6 s: outlives the drain

    def slow() -> None:
        with contextlib.suppress(httpx.HTTPError):   # cut when the drain ends
            stack.client.post("/v1/chat/completions", json=body)

    slow_thread = threading.Thread(target=slow)
    slow_thread.start()
    assert wait_until(loop_thread, lambda: any(w.inflight for w in stack.gateway.workers))
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    answers = {}

    def ask(stream: bool) -> None:
        try:
            client.chat.completions.create(**{**body, "max_tokens": 1}, stream=stream)
            answers[stream] = "answered"
        except openai.APIError as exc:
            answers[stream] = exc

    held = [threading.Thread(target=ask, args=(stream,)) for stream in (False, True)]
    for thread in held:
        thread.start()
    assert wait_until(loop_thread, lambda: len(stack.gateway.holding.binding.queue) == 2)
    stopping = threading.Thread(target=stack.loop.run,
                                args=(stack.server.stop(drain_seconds=1.0),))
    stopping.start()
    assert wait_until(loop_thread, lambda: stack.gateway.draining)
    arrival = httpx.post(stack.url + "/v1/chat/completions", json=body)   # during the drain
    assert arrival.status_code == 503 and arrival.json()["error"]["code"] == "draining"
    for thread in held:
        thread.join(10)
    stopping.join(10)
    slow_thread.join(10)
    for stream in (False, True):
        answer = answers[stream]
        assert isinstance(answer, openai.APIStatusError), (stream, answer)
        assert answer.status_code == 503
        assert answer.body == arrival.json()["error"]   # the same refusal as a new arrival's
        for header in ("retry-after", "connection"):
            assert answer.response.headers[header] == arrival.headers[header], header
    assert stack.gateway.metrics.held_outcomes["rejected",] == 2


def test_a_held_request_goes_to_a_worker_as_soon_as_its_breaker_cool_down_ends(
        make_stack, loop_thread):
    # Before: nothing offered the held requests when a worker's breaker let requests through
    # again: they waited for another request to end (5 s here) or their deadline (30 s).
    stack = make_stack(workers=2, sim=SimConfig(decode_ms_per_token=100.0), late_binding=True,
                       hold_queued_tokens=0, kv_events=False, hold_max_seconds=30.0,
                       breaker_failures=1, breaker_open_seconds=1.0)
    body = {"model": "sim-model", "max_tokens": 50,
            "messages": [{"role": "user", "content": words(0, 40)}]}
    slow = occupy(stack, loop_thread, body)   # 5 s on one worker
    busy = next(w for w in stack.gateway.workers if w.inflight)
    other = next(i for i, url in enumerate(stack.fleet.urls) if url != busy.url)
    stack.fleet.workers[other].error = {}   # it fails the next request: its breaker opens
    failed = stack.client.post("/v1/chat/completions", json={
        **body, "max_tokens": 1, "messages": [{"role": "user", "content": words(1000, 40)}]})
    assert failed.status_code == 500 and stack.worker_of(failed) == other
    stack.fleet.workers[other].error = None
    # a prompt of its own: the busy worker is not its cache owner to wait for
    held, answer = hold(stack, loop_thread, {
        **body, "max_tokens": 1, "messages": [{"role": "user", "content": words(2000, 40)}]})
    held.join(10)
    assert slow.is_alive(), "the held request waited for the slow one to end"
    assert answer["r"].status_code == 200 and stack.worker_of(answer["r"]) == other
    assert held_outcomes(stack).get("placed") == 1
    slow.join(10)


@pytest.mark.parametrize("leaves", ["removed", "terminating", "draining"])
def test_a_request_held_for_its_cache_owner_goes_elsewhere_once_the_owner_leaves(
        make_stack, loop_thread, leaves):
    # Before: a request held for its busy cache owner (the idle worker not worth a copy of its
    # prefix) was not offered again when the owner left the rotation: it waited for the
    # owner's requests to end (5 s here) or its deadline (30 s) with the other worker idle.
    stack = make_stack(workers=2, sim=SimConfig(decode_ms_per_token=100.0), late_binding=True,
                       hold_queued_tokens=0, kv_events=False, hold_max_seconds=30.0)
    body = {"model": "sim-model", "max_tokens": 50,
            "messages": [{"role": "user", "content": words(0, 40)}]}
    slow = occupy(stack, loop_thread, body)   # 5 s at the prefix's owner
    owner = next(w for w in stack.gateway.workers if w.inflight)
    other = next(w for w in stack.gateway.workers if w is not owner)
    short = threading.Thread(target=stack.client.post, args=("/v1/chat/completions",), kwargs={
        "json": {**body, "max_tokens": 10,
                 "messages": [{"role": "user", "content": words(1000, 40)}]}})
    short.start()   # 1 s at the other worker, so that the next request is held, not spilled
    assert wait_until(loop_thread, lambda: other.inflight)
    held, answer = hold(stack, loop_thread, {**body, "max_tokens": 1})
    short.join(10)
    assert wait_until(loop_thread, lambda: not other.inflight)
    assert len(stack.gateway.holding.binding.queue) == 1   # held for its owner
    if leaves == "removed":
        loop_thread.call(stack.gateway.workers.remove, owner.url)
    elif leaves == "terminating":
        loop_thread.call(stack.gateway.workers.reconcile, {other.url}, {owner.url})
    else:   # its /health answers 503
        stack.fleet.workers[stack.fleet.urls.index(owner.url)].fail_health = True
        stack.check_all()
    held.join(10)
    assert slow.is_alive(), "the held request waited for its owner's request to end"
    assert answer["r"].status_code == 200
    assert answer["r"].headers["x-radixpool-worker"] == other.url
    slow.join(10)


def test_a_held_request_goes_to_a_worker_whose_endpoint_is_ready_again(make_stack, loop_thread):
    # Before: discovery clearing a worker's `terminating` (its endpoint ready again) offered
    # the held requests nothing: they waited for another request to end (5 s here).
    stack = make_stack(workers=2, sim=SimConfig(decode_ms_per_token=100.0), late_binding=True,
                       hold_queued_tokens=0, kv_events=False, hold_max_seconds=30.0)
    first, second = stack.fleet.urls
    loop_thread.call(stack.gateway.workers.reconcile, {first}, {second})
    body = {"model": "sim-model", "max_tokens": 50,
            "messages": [{"role": "user", "content": words(0, 40)}]}
    slow = occupy(stack, loop_thread, body)   # 5 s on the first, the only one in rotation
    # a prompt of its own: the busy worker is not its cache owner to wait for
    held, answer = hold(stack, loop_thread, {
        **body, "max_tokens": 1, "messages": [{"role": "user", "content": words(2000, 40)}]})
    loop_thread.call(stack.gateway.workers.reconcile, {first, second}, set())
    held.join(10)
    assert slow.is_alive(), "the held request waited for the slow one to end"
    assert answer["r"].status_code == 200
    assert answer["r"].headers["x-radixpool-worker"] == second
    slow.join(10)


def break_kv_events(stack, sim) -> threading.Thread:
    """The worker's `/kv_events` answers 500 from now on (its snapshot still works); a request
    around the gateway changes the worker's load, so that the open poll answers and the next
    one fails. Returns that request's thread: it ends once the worker's queued prefills do."""
    from bench.simfleet.http_server import error_body

    async def broken(request, respond) -> None:
        await respond.send(*error_body(500, "event log unavailable"))

    sim.kv_events = broken
    around = threading.Thread(target=httpx.post, args=(sim.url + "/generate",),
                              kwargs={"json": {"text": words(3000, 5), "max_tokens": 1},
                                      "timeout": 30})
    around.start()
    return around


def held_behind_a_long_prefill(make_stack, loop_thread, sim: SimConfig, answered_words: int,
                               long_tokens: int):
    """One worker with its KV events followed: a prompt of `answered_words` answered (it sets
    the estimate of its queue without events), then a long prompt (200 uncached tokens,
    `long_tokens` of output) that the events count as queued, and a request held behind it.
    Returns the stack, the simulated worker, the long request's thread, and `hold`'s pair."""
    stack = make_stack(workers=1, sim=sim, late_binding=True, hold_queued_tokens=100,
                       hold_max_seconds=30.0)
    worker = stack.gateway.workers.get(stack.fleet.urls[0])
    assert wait_until(loop_thread, lambda: worker.kv_events_live)
    body = {"model": "sim-model", "max_tokens": 1,
            "messages": [{"role": "user", "content": words(0, answered_words)}]}
    assert stack.client.post("/v1/chat/completions", json=body).status_code == 200
    slow = occupy(stack, loop_thread, {**body, "max_tokens": long_tokens, "messages": [
        {"role": "user", "content": words(1000, 200)}]})
    assert wait_until(loop_thread, lambda: worker.queued(0) > 100)
    held, answer = hold(stack, loop_thread, {**body, "messages": [
        {"role": "user", "content": words(2000, 10)}]})
    return stack, stack.fleet.workers[0], slow, held, answer


def test_a_held_request_is_offered_again_when_its_workers_kv_events_stop(
        make_stack, loop_thread):
    # Before: a request held because the KV events counted a long prefill queued at its worker
    # stayed held when the event stream broke and the gateway fell back to estimating that
    # queue from the worker's answers (small here): it waited for the long request to end.
    stack, sim, slow, held, answer = held_behind_a_long_prefill(
        make_stack, loop_thread, SimConfig(prefill_us_per_token=15000.0), 10, 1)  # 3 s prefill
    around = break_kv_events(stack, sim)
    assert wait_until(loop_thread, lambda: not stack.gateway.holding)
    assert slow.is_alive(), "the held request waited for the long one to end"
    assert held_outcomes(stack).get("placed") == 1
    for thread in (held, slow, around):
        thread.join(30)
    assert answer["r"].status_code == 200


def test_a_held_request_is_offered_again_when_a_resync_shows_the_prefill_it_waited_for_ended(
        make_stack, loop_thread):
    # Before: a prefill that ended while the KV events were not followed was still counted as
    # queued after a resync from the worker's snapshot (its event was never seen), and the
    # held request waited for the long request's answer to end (5 s of decode here).
    # A long answered prompt: the estimate without events keeps the request held too.
    stack, sim, slow, held, answer = held_behind_a_long_prefill(
        make_stack, loop_thread, SimConfig(prefill_us_per_token=5000.0,
                                           decode_ms_per_token=100.0), 300, 50)
    around = break_kv_events(stack, sim)
    # queued after the long prompt: once it is answered, the long prefill has ended. The
    # gateway retries the events every half second, each time from the worker's snapshot,
    # which holds the long prompt now
    around.join(30)
    assert wait_until(loop_thread, lambda: not stack.gateway.holding)
    assert slow.is_alive(), "the held request waited for the long one to end"
    for thread in (held, slow):
        thread.join(30)
    assert answer["r"].status_code == 200
