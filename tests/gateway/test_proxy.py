"""The proxy as a client sees it: streaming, errors, retries, failures, admin, auth, metrics."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from bench.simfleet import SimConfig, SimFleet, SimWorker, kill
from tests.gateway.conftest import words


def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def served(stack) -> int:
    return sum(w.requests for w in stack.fleet.workers)


def test_streams_pass_through_and_the_added_usage_event_is_stripped(make_stack):
    stack = make_stack(2)
    client = sdk(stack)
    messages = [{"role": "user", "content": words(0, 100)}]
    chunks = list(client.chat.completions.create(model="sim-model", messages=messages,
                                                 max_tokens=5, stream=True))
    assert "".join(c.choices[0].delta.content for c in chunks) == "w0 w1 w2 w3 w4 "
    assert all(c.choices for c in chunks)  # the client did not ask for usage: none arrives
    declined = list(client.chat.completions.create(
        model="sim-model", messages=messages, max_tokens=2, stream=True,
        stream_options={"include_usage": False}))
    assert len(declined) == 2 and all(c.choices for c in declined)
    with_usage = list(client.chat.completions.create(
        model="sim-model", messages=messages, max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.prompt_tokens_details \
        .cached_tokens > 0
    # a client that writes unset fields as null: the option is still added (a splice before
    # the client's own member was overridden by it) and its event still stripped
    with stack.client.stream("POST", "/v1/chat/completions", json={
            "model": "sim-model", "messages": messages, "max_tokens": 2, "stream": True,
            "stream_options": None}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert len(events) == 2 and all('"usage"' not in e or '"choices":[]' not in e.replace(
        " ", "") for e in events), events
    stack.settle()
    fleet = stack.client.get("/workers").json()["fleet"]
    assert fleet["prompt_tokens"] == 4 * with_usage[-1].usage.prompt_tokens  # all learned
    text = list(client.completions.create(model="sim-model", prompt=words(5, 40), max_tokens=3,
                                          stream=True))
    assert "".join(c.choices[0].text for c in text) == "w0 w1 w2 "
    with stack.client.stream("POST", "/generate", json={"text": words(0, 20), "stream": True,
                                                        "max_tokens": 2}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and '"meta_info"' in events[0]


def test_non_streamed_endpoints_and_models(make_stack):
    stack = make_stack(2)
    r = stack.client.post("/generate", json={"input_ids": list(range(40)), "max_tokens": 1})
    assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] == 40
    completion = sdk(stack).completions.create(model="sim-model", prompt=words(0, 10),
                                               max_tokens=2)
    assert completion.choices[0].text == "w0 w1"
    assert [m.id for m in sdk(stack).models.list()] == ["sim-model"]


def test_the_model_list_names_every_model_the_fleet_serves(make_stack):
    """Workers serving different models: the gateway routes requests for each, so its model
    list names each (it once showed one worker's list, whichever was least loaded)."""
    stack = make_stack(3)
    stack.fleet.workers[2].config = SimConfig(model="other-model")
    stack.check_all()   # the next health round learns what each serves
    client = sdk(stack)
    for _ in range(3):
        assert sorted(m.id for m in client.models.list()) == ["other-model", "sim-model"]
    answer = client.completions.with_raw_response.create(model="other-model",
                                                         prompt=words(0, 10), max_tokens=2)
    assert answer.headers["x-radixpool-worker"] == stack.fleet.urls[2]
    stack.gateway.workers.get(stack.fleet.urls[2]).draining = True
    # no eligible worker serves it any more: it is not listed
    assert [m.id for m in client.models.list()] == ["sim-model"]


def test_a_model_whose_workers_are_all_down_gets_503_not_another_models_404(make_stack):
    """While every worker of a model restarts, its requests get a retryable 503 (the SDK
    retries it), not a worker of another model answering 404 model_not_found (not retried:
    the client is told the model does not exist). A model nobody serves still gets the 404."""
    stack = make_stack(2)
    stack.fleet.workers[1].config = SimConfig(model="other-model")
    stack.check_all()
    stack.gateway.workers.get(stack.fleet.urls[1]).draining = True   # its only worker
    client = sdk(stack)
    with pytest.raises(openai.InternalServerError) as down:
        client.completions.create(model="other-model", prompt=words(0, 10), max_tokens=2)
    assert down.value.status_code == 503 and "other-model" in down.value.body["message"]
    assert down.value.response.headers["retry-after"] == "1"
    with pytest.raises(openai.InternalServerError) as down:
        client.models.retrieve("other-model")
    assert down.value.response.headers["retry-after"] == "1"
    assert stack.fleet.workers[0].requests == 0   # sim-model's worker never saw them
    stack.gateway.workers.get(stack.fleet.urls[1]).draining = False   # back: served again
    assert client.completions.create(model="other-model", prompt=words(0, 10),
                                     max_tokens=2).model == "other-model"


def test_model_names_nobody_serves_cost_the_router_no_memory_each(make_stack):
    """The router keeps prefix demand per model; names no worker serves share one count, so a
    client inventing model names cannot grow the gateway's memory with them."""
    stack = make_stack(2)
    for i in range(20):
        r = stack.client.post("/v1/completions", json={
            "model": f"made-up-{i}", "prompt": words(100 * i, 40), "max_tokens": 1})
        assert r.status_code == 200   # the simulated workers serve any name
    stack.client.post("/v1/completions", json={"model": "sim-model", "prompt": words(0, 40),
                                               "max_tokens": 1})
    assert set(stack.gateway.policy._demand) <= {None, "sim-model"}


def test_bad_input_gets_a_4xx_without_reaching_a_worker(make_stack):
    stack = make_stack(2, max_body_bytes=10_000)
    c = stack.client
    lone_surrogate = b'{"model": "sim-model", "prompt": "w1 \\ud800 w2", "max_tokens": 1}'
    cases = [  # the response, its status, words of its message, its param and code
        (c.post("/v1/chat/completions", content=b"{not json"), 400, "not valid JSON", None,
         "invalid_json"),
        (c.post("/v1/chat/completions", json={"messages": "hi"}), 400, "'messages'", "messages",
         None),
        (c.post("/v1/chat/completions", json={"messages": [{"role": "user"}, "hi"]}), 400,
         "messages[1]", "messages[1]", None),
        (c.post("/v1/completions", json={"model": "sim-model"}), 400, "'prompt'", "prompt",
         "missing_field"),
        (c.post("/v1/completions", json={"model": 5, "prompt": "w1"}), 400, "'model'", "model",
         None),
        (c.post("/v1/completions", content=lone_surrogate), 400, "lone UTF-16 surrogate",
         "prompt", None),
        (c.post("/generate", content=b'{"text": ["w1 \\udc80"]}'), 400, "lone UTF-16 surrogate",
         "text[0]", None),
        # nested past Python's parser (its RecursionError was a 400 naming nothing)
        (c.post("/v1/chat/completions", content=b'{"model": "sim-model", "messages": [{"role": '
                b'"user", "content": ' + b"[" * 3000 + b"]" * 3000 + b"}]}"), 400,
         "nests more than 200 levels deep (line 1, column", "messages[0].content[0][0][0][0][0]",
         "invalid_json"),
        # nested past the workers' parser but not Python's: refused here as well
        (c.post("/v1/completions", content=b'{"model": "sim-model", "prompt": "w1", "stop": '
                + b"[" * 250 + b"]" * 250 + b"}"), 400,
         "nests more than 200 levels deep (line 1, column", "stop[0][0][0][0][0][0][0]",
         "invalid_json"),
        (c.post("/v2/everything", json={}), 404, "unknown path", None, "not_found"),
        (c.get("/workers/anything"), 404, "unknown path", None, "not_found"),
        (c.get("/v1/chat/completions"), 405, "accepts POST", None, "method_not_allowed"),
        (c.post("/generate", json={"text": "x" * 20_000}), 413, "exceeds the limit", None,
         "request_too_large"),
    ]
    for response, status, message, param, code in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert message in error["message"]
        # the shape the workers answer with, so an OpenAI client reads both alike
        assert (error["param"], error["code"]) == (param, code), error
        assert error["type"] == "invalid_request_error"
    assert served(stack) == 0
    # as a worker answers them: the SDK reads the code, and the methods are in Allow
    for method, path, allowed in (("GET", "/v1/completions", "POST"),
                                  ("POST", "/v1/models", "GET, HEAD"),
                                  ("DELETE", "/v1/models/sim-model", "GET, HEAD")):
        r = c.request(method, path)
        assert (r.status_code, r.headers.get("allow")) == (405, allowed), (method, path)
        assert r.json()["error"]["code"] == "method_not_allowed"
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk(stack).embeddings.create(model="sim-model", input="w1")
    assert unknown.value.code == "not_found"
    assert c.get("/health").status_code == 200  # and the gateway keeps serving
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(stack).chat.completions.create(model="sim-model", messages=[], max_tokens=1)
    assert refused.value.param == "messages" and refused.value.code is None


def test_a_workers_4xx_passes_through_unchanged(make_stack):
    stack = make_stack(1)
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "w1"}],
            "max_tokens": -1}
    direct = httpx.post(stack.fleet.urls[0] + "/v1/chat/completions", json=body)
    via = stack.client.post("/v1/chat/completions", json=body)
    assert via.status_code == direct.status_code == 400
    assert via.content == direct.content
    try:
        sdk(stack).chat.completions.create(**body)
    except openai.BadRequestError as exc:
        assert "max_tokens" in str(exc)
    else:
        raise AssertionError("expected a 400")


def test_503_is_retried_on_another_worker_and_the_draining_worker_is_skipped(make_stack):
    stack = make_stack(3)
    stack.client.post(stack.fleet.urls[0] + "/sim/fail", json={"requests": True})
    for i in range(12):
        r = stack.client.post("/generate", json={"text": words(i * 50, 40)})
        assert r.status_code == 200
        assert stack.worker_of(r) != 0
    stack.settle()
    assert stack.gateway.workers.get(stack.fleet.urls[0]).draining
    metrics = stack.client.get("/metrics").text
    assert "radixpool_gateway_retries_total 1.0" in metrics
    for url in stack.fleet.urls:
        stack.client.post(url + "/sim/fail", json={"requests": True})
    stack.check_all()
    everyone_busy = stack.client.post("/generate", json={"text": "w1"})
    assert everyone_busy.status_code == 503 and everyone_busy.headers["retry-after"] == "1"
    for url in stack.fleet.urls:
        stack.client.post(url + "/sim/fail", json={})
    stack.check_all()  # its /health says 200 again: back in rotation
    assert stack.gateway.workers.get(stack.fleet.urls[0]).eligible(stack.gateway.clock())


def test_killing_a_worker_mid_run_loses_no_request(make_stack):
    stack = make_stack(3, sim=SimConfig(prefill_us_per_token=200.0))
    results: list[int] = []
    errors: list[str] = []

    def client_thread(t: int) -> None:
        with httpx.Client(base_url=stack.url, timeout=30) as c:
            for i in range(10):
                try:
                    r = c.post("/generate", json={"text": words(t * 1000 + i * 60, 50)})
                    results.append(r.status_code)
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))

    threads = [threading.Thread(target=client_thread, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    while len(results) < 12:
        threading.Event().wait(0.005)
    stack.loop.run(kill(stack.fleet.workers[1]))
    for t in threads:
        t.join(60)
    assert errors == [] and results == [200] * 60
    stack.settle()
    assert 'reason="retry"' in stack.client.get("/metrics").text  # some were cut and retried
    survivors = stack.fleet.workers[0].requests + stack.fleet.workers[2].requests
    for i in range(6):  # and the others keep being served
        assert stack.client.post("/generate", json={"text": words(i, 30)}).status_code == 200
    assert stack.fleet.workers[0].requests + stack.fleet.workers[2].requests == survivors + 6
    stack.check_all()
    stack.check_all()
    stack.check_all()
    assert stack.client.get("/workers").json()["workers"][1]["healthy"] is False


def test_active_health_checks_take_a_worker_out_after_n_failures(make_stack):
    stack = make_stack(2, health_failures=2, health_successes=2)
    bad = stack.fleet.urls[1]
    stack.client.post(bad + "/sim/fail", json={"health": True})
    stack.check_all()
    worker = stack.gateway.workers.get(bad)
    assert worker.draining and worker.health.healthy  # out of rotation at once, not yet down
    stack.check_all()
    healthy_series = 'radixpool_gateway_worker_healthy{worker="' + bad + '"} 0.0'
    assert healthy_series in stack.client.get("/metrics").text
    for i in range(4):
        assert stack.worker_of(stack.client.post("/generate", json={"text": words(i, 20)})) == 0
    stack.client.post(bad + "/sim/fail", json={})
    stack.check_all()
    assert not stack.gateway.workers.get(bad).health.healthy   # one success is not enough
    stack.check_all()
    assert stack.gateway.workers.get(bad).health.healthy


def test_workers_view_says_why_a_worker_failed_its_health_check(make_stack):
    # a worker whose model gives only NaN answers /health 503 with code nonfinite_logits: the
    # gateway's view names it, so "down" is not read as a slow start or a drain
    stack = make_stack(2, health_failures=1)
    bad = stack.fleet.urls[1]
    stack.client.post(bad + "/sim/fail", json={"health": {
        "status": "failed", "code": "nonfinite_logits", "message": "the model is broken"}})
    stack.check_all()
    view = {w["url"]: w for w in stack.client.get("/workers").json()["workers"]}
    assert view[bad]["health_failure"] == {"status": 503, "code": "nonfinite_logits"}
    assert not view[bad]["healthy"] and not view[bad]["eligible"]
    assert view[stack.fleet.urls[0]]["health_failure"] is None
    stack.client.post(bad + "/sim/fail", json={})
    stack.check_all()
    assert stack.client.get("/workers").json()["workers"][1]["health_failure"] is None


def test_admin_adds_and_removes_workers_and_removal_lets_streams_finish(make_stack):
    stack = make_stack(1, sim=SimConfig(decode_ms_per_token=20.0), admin_api_key="admin")
    admin = {"authorization": "Bearer admin"}
    extra = SimFleet(1, SimConfig(decode_ms_per_token=20.0))
    stack.loop.run(extra.start())
    try:
        added = stack.client.post("/workers", json={"url": extra.urls[0]}, headers=admin)
        assert added.status_code == 200 and added.json()["url"] == extra.urls[0]
        assert len(stack.client.get("/workers").json()["workers"]) == 2
        assert stack.client.post("/workers", json={"nope": 1}, headers=admin).status_code == 400
        assert stack.client.delete("/workers", params={"url": "http://127.0.0.1:1"},
                                 headers=admin).status_code == 404
        with stack.client.stream("POST", "/v1/completions", json={
                "prompt": words(0, 10), "max_tokens": 15, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(lines)
            owner = r.headers["x-radixpool-worker"]
            removed = stack.client.delete("/workers", params={"url": owner}, headers=admin)
            assert removed.json() == {"removed": owner, "inflight_finishing": 1}
            rest = [line for line in lines if line.startswith("data:")]
        assert first.startswith("data:") and rest[-1] == "data: [DONE]" and len(rest) == 15
        remaining = [w["url"] for w in stack.client.get("/workers").json()["workers"]]
        assert owner not in remaining and len(remaining) == 1
        r = stack.client.post("/generate", json={"text": words(0, 10)})
        assert r.headers["x-radixpool-worker"] == remaining[0]
    finally:
        stack.loop.run(extra.stop())


def test_a_worker_added_back_while_its_streams_run_is_not_taken_for_idle(make_stack):
    """Removed and added back (an endpoint briefly not ready, an admin's undo) while streams
    still run on it: the gateway keeps counting them (it once saw an idle worker, routed the
    next requests there, and showed in-flight 0 while they were relayed)."""
    stack = make_stack(2, sim=SimConfig(decode_ms_per_token=40.0), admin_api_key="admin")
    admin = {"authorization": "Bearer admin"}
    busy, other = stack.fleet.urls
    stack.gateway.workers.get(other).draining = True   # both streams go to `busy`
    streams = [stack.client.stream("POST", "/v1/completions", json={
        "prompt": words(100 * i, 10), "max_tokens": 25, "stream": True}) for i in range(2)]
    lines = [s.__enter__().iter_lines() for s in streams]
    assert [next(each).startswith("data:") for each in lines] == [True, True]
    stack.gateway.workers.get(other).draining = False
    assert stack.client.delete("/workers", params={"url": busy}, headers=admin).json() == \
        {"removed": busy, "inflight_finishing": 2}
    assert stack.client.post("/workers", json={"url": busy}, headers=admin).status_code == 200
    stack.check_all()

    def inflight() -> dict[str, int]:
        return {w["url"]: w["inflight"] for w in stack.client.get("/workers").json()["workers"]}

    assert inflight() == {busy: 2, other: 0}
    cold = stack.client.post("/v1/completions", json={"prompt": words(900, 10), "max_tokens": 1})
    assert cold.headers["x-radixpool-worker"] == other   # the least loaded, not the re-added
    for stream, each in zip(streams, lines):
        assert [line for line in each if line.startswith("data:")][-1] == "data: [DONE]"
        stream.__exit__(None, None, None)
    stack.settle()
    assert inflight() == {busy: 0, other: 0}


def test_api_key_guards_everything_but_health_and_metrics(make_stack):
    stack = make_stack(1, api_key="s3cret")
    r = stack.client.post("/generate", json={"text": "w1"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert stack.client.get("/workers").status_code == 401
    assert stack.client.get("/health").status_code == 200
    assert stack.client.get("/metrics").status_code == 200
    ok = openai.OpenAI(base_url=stack.url + "/v1", api_key="s3cret", max_retries=0)
    assert ok.completions.create(model="sim-model", prompt="w1", max_tokens=1).choices


def test_the_gateways_own_refusals_have_the_type_a_worker_gives_their_status(make_stack):
    """The SDK exposes the error's `type`: a worker's 401 says `authentication_error` and its
    503 `service_unavailable`, and the gateway's own said `invalid_request_error` and
    `server_error` for the same status."""
    stack = make_stack(1, api_key="s3cret")
    wrong = openai.OpenAI(base_url=stack.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.completions.create(model="sim-model", prompt="w1", max_tokens=1)
    assert (refused.value.type, refused.value.code) == ("authentication_error", "invalid_api_key")
    stack.loop.run(kill(stack.fleet.workers[0]))
    for _ in range(3):
        stack.check_all()
    keyed = openai.OpenAI(base_url=stack.url + "/v1", api_key="s3cret", max_retries=0)
    with pytest.raises(openai.InternalServerError) as unavailable:
        keyed.completions.create(model="sim-model", prompt="w1", max_tokens=1)
    assert unavailable.value.status_code == 503
    assert unavailable.value.type == "service_unavailable"
    admin = stack.client.post("/workers", json={"url": "http://127.0.0.1:1"},
                              headers={"authorization": "Bearer s3cret"})
    assert (admin.status_code, admin.json()["error"]["type"]) == (403, "permission_error")


def test_the_gateway_presents_its_worker_key_to_keyed_workers(make_stack):
    stack = make_stack(2, sim=SimConfig(api_key="worker-key"), api_key="client-key",
                       worker_api_key="worker-key")
    workers = stack.client.get("/workers", headers={"authorization": "Bearer client-key"}).json()
    assert workers["routing_on"] == "tokens"  # its checks could read /server_info, /tokenizer
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="client-key", max_retries=0)
    assert client.completions.create(model="sim-model", prompt="w1", max_tokens=1).choices
    direct = httpx.post(stack.fleet.urls[0] + "/generate", json={"text": "w1"},
                        headers={"authorization": "Bearer client-key"})
    assert direct.status_code == 401  # the workers really do check


def test_headers_the_client_names_in_connection_stay_at_the_gateway(make_stack, monkeypatch):
    # RFC 9110 7.6.1: the fields a request's `Connection` names are for that hop alone, and a
    # proxy removes them; the gateway passed them on to the workers
    seen: list[dict[bytes, bytes]] = []
    serve = SimWorker.__call__

    async def recording(self, request, respond) -> None:
        if request.path == "/v1/completions":
            seen.append(request.headers)
        await serve(self, request, respond)

    monkeypatch.setattr(SimWorker, "__call__", recording)
    stack = make_stack(1)
    answer = stack.client.post(
        "/v1/completions", json={"model": "sim-model", "prompt": "w1", "max_tokens": 1},
        headers={"connection": "keep-alive, X-Hop-Only", "x-hop-only": "1",
                 "x-end-to-end": "1", "x-request-id": "mine",
                 "proxy-authorization": "Basic cHJveHk6c2VjcmV0"})   # a forward proxy's
    assert answer.status_code == 200
    forwarded, = seen
    assert b"x-hop-only" not in forwarded and b"proxy-authorization" not in forwarded
    assert forwarded[b"x-end-to-end"] == b"1" and forwarded[b"x-request-id"] == b"mine"


def test_no_worker_means_503_and_unhealthy_gateway(make_stack):
    stack = make_stack(1)
    stack.loop.run(kill(stack.fleet.workers[0]))
    r = stack.client.post("/generate", json={"text": "w1 w2"})
    assert r.status_code == 502 and "attempts failed" in r.json()["error"]["message"]
    for _ in range(3):
        stack.check_all()
    assert stack.client.get("/health").status_code == 503
    r = stack.client.post("/generate", json={"text": "w1 w2"})
    assert r.status_code == 503 and "no healthy worker" in r.json()["error"]["message"]
    # the answers the gateway gave itself are counted (an outage read as zero errors before)
    metrics = stack.client.get("/metrics").text
    assert 'radixpool_gateway_requests_total{code="502",worker="gateway"} 1.0' in metrics
    assert 'radixpool_gateway_requests_total{code="503",worker="gateway"} 1.0' in metrics


def test_a_refused_request_leaves_nothing_in_the_workers_tree(make_stack):
    # The prompt went into the chosen worker's tree at selection, and a 4xx answer left it
    # there: later requests were routed as cache hits on prefixes no worker held.
    stack = make_stack(1, kv_events=False)
    refused = stack.client.post("/v1/completions", json={
        "model": "sim-model", "prompt": words(100, 64), "max_tokens": -1})
    assert refused.status_code == 400   # the worker's own refusal
    row = stack.client.get("/workers").json()["workers"][0]
    assert row["tree_blocks"] == 0, row


def test_keys_are_read_as_the_workers_read_them(make_stack):
    stack = make_stack(1, api_key="client-key")
    body = {"model": "sim-model", "prompt": "w1", "max_tokens": 1}
    for headers in ({"authorization": "bearer client-key"},
                    {"authorization": "BEARER  client-key"},
                    {"x-api-key": "client-key"}):
        assert stack.client.post("/v1/completions", json=body, headers=headers
                                 ).status_code == 200, headers
    for headers in ({"authorization": "Bearer wrong"}, {"authorization": "client-key"}, {}):
        r = stack.client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", headers


def test_metrics_carry_the_contract_names(make_stack):
    from radixpool.protocol.metrics import GATEWAY_METRICS

    stack = make_stack(2)
    client = sdk(stack)
    for i in range(3):
        client.chat.completions.create(model="sim-model", max_tokens=1, messages=[
            {"role": "user", "content": words(0, 64) + f" w{100 + i}"}])
    stack.settle()
    text = stack.client.get("/metrics").text
    for spec in GATEWAY_METRICS:
        if spec.name != "radixpool_gateway_retries_total":
            assert spec.series[0] in text, spec.name
    assert 'reason="cache_hit"' in text and 'reason="cache_miss"' in text
    assert 'radixpool_gateway_hit_rate{kind="actual",worker="all"}' in text


def test_hit_rates_keep_the_history_of_removed_and_readded_workers(make_stack):
    """The hit-rate gauges are "since start", as the token counters beside them: a worker
    removed (a scale-down, an endpoint briefly not ready) takes no history out of the fleet's
    rate, and one added back on the same address continues its own (both once restarted at 0)."""
    from prometheus_client.parser import text_string_to_metric_families

    stack = make_stack(2, admin_api_key="admin")
    admin = {"authorization": "Bearer admin"}
    client = sdk(stack)
    for i in range(4):
        client.chat.completions.create(model="sim-model", max_tokens=1, messages=[
            {"role": "user", "content": words(0 if i else 500, 64) + f" w{3000 + i}"}])
    stack.settle()

    def scrape() -> tuple[dict, dict]:
        totals, rates = {}, {}
        for family in text_string_to_metric_families(stack.client.get("/metrics").text):
            for s in family.samples:
                if s.name in ("radixpool_gateway_prompt_tokens_total",
                              "radixpool_gateway_cached_tokens_total"):
                    totals[s.name] = totals.get(s.name, 0) + s.value
                    totals[s.name, s.labels["worker"]] = s.value
                elif s.name == "radixpool_gateway_hit_rate" and s.labels["kind"] == "actual":
                    rates[s.labels["worker"]] = s.value
        return totals, rates

    def rate(totals: dict, worker: str | None = None) -> float:
        return (totals["radixpool_gateway_cached_tokens_total", worker]
                / totals["radixpool_gateway_prompt_tokens_total", worker]) if worker else \
            (totals["radixpool_gateway_cached_tokens_total"]
             / totals["radixpool_gateway_prompt_tokens_total"])

    totals, rates = scrape()
    assert rates["all"] == pytest.approx(rate(totals)) and rates["all"] > 0.3
    gone = max(stack.fleet.workers, key=lambda w: w.cached_tokens).url   # one that hit
    assert stack.client.delete("/workers", params={"url": gone}, headers=admin).status_code == 200
    totals, rates = scrape()
    assert gone not in rates   # only workers in the fleet have a gauge of their own
    assert rates["all"] == pytest.approx(rate(totals)), "the fleet's rate lost history"
    assert stack.client.post("/workers", json={"url": gone}, headers=admin).status_code == 200
    totals, rates = scrape()
    assert rates[gone] == pytest.approx(rate(totals, gone)) and rates[gone] > 0.3


def test_gateway_never_imports_torch():
    code = ("import sys, radixpool.gateway.server, radixpool.gateway.cli, "
            "bench.simfleet; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_runs_the_gateway_and_rejects_bad_flags(loop_thread, tmp_path):
    import socket

    bad = subprocess.run([sys.executable, "-m", "radixpool.cli", "gateway", "--cache-threshold",
                          "7"], capture_output=True, text=True)
    assert bad.returncode == 2 and "cache_threshold" in bad.stderr
    fleet = SimFleet(1, SimConfig())
    loop_thread.run(fleet.start())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "radixpool.cli", "gateway", "--worker-urls",
                             fleet.urls[0], "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(200):
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"text": "w1 w2"})
                break
            except httpx.ConnectError:
                threading.Event().wait(0.05)
        assert r.status_code == 200 and json.loads(r.content)["meta_info"]["prompt_tokens"] == 2
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
        loop_thread.run(fleet.stop())


def test_expect_100_continue_is_answered_at_once(make_stack):
    import socket as sock

    stack = make_stack(1)
    body = json.dumps({"text": words(0, 300)}).encode()
    with sock.create_connection(("127.0.0.1", stack.server.port), timeout=5) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(body))
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(body)
        answer = b""
        while b'"finish_reason"' not in answer:
            answer += s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200")


def test_a_client_that_hangs_up_mid_stream_frees_the_worker(make_stack):
    stack = make_stack(1, sim=SimConfig(decode_ms_per_token=10.0))
    with stack.client.stream("POST", "/v1/completions", json={
            "prompt": words(0, 10), "max_tokens": 200, "stream": True}) as r:
        assert next(r.iter_lines()).startswith("data:")
    for _ in range(100):  # the gateway notices at the next event and closes the upstream
        stack.settle()
        if stack.gateway.workers.get(stack.fleet.urls[0]).inflight == 0:
            break
        threading.Event().wait(0.02)
    assert stack.gateway.workers.get(stack.fleet.urls[0]).inflight == 0
    assert stack.client.post("/generate", json={"text": "w1"}).status_code == 200


def test_a_stream_cut_by_a_dying_worker_ends_with_an_error_event_and_no_done(make_stack):
    stack = make_stack(1, sim=SimConfig(decode_ms_per_token=20.0))
    lines = []
    with httpx.Client(base_url=stack.url, timeout=10) as c, c.stream(
            "POST", "/v1/completions",
            json={"prompt": words(0, 10), "max_tokens": 100, "stream": True}) as r:
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 2:
                stack.loop.run(kill(stack.fleet.workers[0]))
    events = [line for line in lines if line.startswith("data: ")]
    assert "data: [DONE]" not in lines  # the client can tell the answer is short
    assert json.loads(events[-1][6:])["error"]["code"] == "worker_failed"


def test_cli_startup_errors_are_one_clear_line_and_exit_2(tmp_path):
    import os

    env = {**os.environ, "KUBECONFIG": str(tmp_path / "missing"),
           "KUBERNETES_SERVICE_HOST": ""}
    cases = [(["--k8s-service", "pool"], "no usable kubeconfig"),
             (["--tokenizer", str(tmp_path)], "tokenizer.json")]
    for flags, message in cases:
        run = subprocess.run([sys.executable, "-m", "radixpool.cli", "gateway", "--host",
                              "127.0.0.1", "--port", "0", *flags],
                             capture_output=True, text=True, env=env, timeout=60)
        assert run.returncode == 2 and message in run.stderr, run.stderr
        assert "Traceback" not in run.stderr


def test_a_stopping_gateway_refuses_new_requests_and_finishes_its_streams(make_stack):
    # 150 tokens at 20 ms each: a 3 s stream. The old gateway kept taking new requests while
    # it drained, so steady traffic held it up for the whole drain and was then cut.
    stack = make_stack(1, sim=SimConfig(decode_ms_per_token=20.0))
    client = sdk(stack)
    stream = client.completions.create(model="sim-model", prompt=words(0, 10), max_tokens=150,
                                       stream=True)
    first = next(iter(stream))
    stopping = asyncio.run_coroutine_threadsafe(stack.server.stop(drain_seconds=30.0),
                                                stack.loop.loop)
    with pytest.raises(openai.InternalServerError) as refused:
        client.completions.create(model="sim-model", prompt=words(50, 10), max_tokens=2)
    assert refused.value.status_code == 503 and refused.value.code == "draining"
    assert refused.value.response.headers["retry-after"] == "1"
    # and to go elsewhere: a kept-alive connection to a gateway about to exit would fail later
    assert refused.value.response.headers["connection"] == "close"
    health = stack.client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert health.headers["connection"] == "close"
    rest = list(stream)
    assert first.choices and rest[-1].choices[0].finish_reason == "length"
    stopping.result(timeout=30)  # closed once its stream was done
