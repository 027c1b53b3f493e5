"""The gateway against workers that hang and clients that leave: upstream deadlines (504, counted,
the breaker told), cancellation of the worker's request when its client goes, and health checks
that time out without leaking connections."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import posixpath
import socket
import threading
import time
from typing import ClassVar
from urllib.parse import unquote

import httpx
import pytest

from bench.simfleet import SimConfig
from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.server import GatewayServer
from tests.gateway.conftest import words


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def leave_early(url: str, body: dict, after: float) -> None:
    """Send `body` and hang up after `after` seconds without reading the answer."""
    with pytest.raises(httpx.TimeoutException), httpx.Client(timeout=after) as c:
        if body.get("stream"):
            with c.stream("POST", url + "/v1/completions", json=body) as r:
                for _ in r.iter_bytes():
                    pass
        else:
            c.post(url + "/v1/completions", json=body)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_the_workers_request(make_stack, stream):
    # the worker spends 6 s on the prompt before its first byte: the old gateway held the request
    # open until then (a stream was cancelled only when the worker's next chunk arrived)
    stack = make_stack(1, sim=SimConfig(prefill_us_per_token=200_000.0), kv_events=False)
    worker = stack.fleet.workers[0]
    thread = threading.Thread(target=leave_early, args=(
        stack.url, {"prompt": words(0, 30), "max_tokens": 60, "stream": stream}, 1.0))
    thread.start()
    assert wait_for(lambda: worker.running == 1, 5)   # the worker is on it
    in_flight_connections = len(worker.connections)
    thread.join(10)
    # the gateway closed its connection to the worker (which aborts there) and let go
    assert wait_for(lambda: stack.gateway.workers.get(worker.url).inflight == 0, 3)
    assert wait_for(lambda: len(worker.connections) < in_flight_connections, 3)
    # counted once, as a client that left (a non-streamed one leaves before any header came)
    assert dict(stack.gateway.metrics.requests) == {(worker.url, "499"): 1}


def test_a_hung_worker_is_cut_by_the_first_byte_timeout(make_stack):
    stack = make_stack(1, sim=SimConfig(prefill_us_per_token=1_000_000.0),
                       upstream_first_byte_timeout=0.5, breaker_failures=1)
    url = stack.fleet.urls[0]
    started = time.monotonic()
    r = stack.client.post("/v1/completions", json={"prompt": words(0, 8), "max_tokens": 1})
    assert r.status_code == 504 and time.monotonic() - started < 5
    error = r.json()["error"]
    assert error["type"] == "server_error" and "timed out" in error["message"]
    assert error["code"] == "worker_timeout"   # as a stream cut for it says
    stack.settle()
    assert stack.gateway.workers.get(url).inflight == 0
    assert f'radixpool_gateway_upstream_timeouts_total{{worker="{url}"}} 1.0' in \
        stack.client.get("/metrics").text
    row = next(w for w in stack.client.get("/workers").json()["workers"] if w["url"] == url)
    assert row["circuit_breaker"] == "open"   # the breaker learned of it
    metrics = stack.client.get("/metrics").text   # and so does an SRE's dashboard
    assert f'radixpool_gateway_breaker_state{{state="open",worker="{url}"}} 1.0' in metrics
    assert f'radixpool_gateway_breaker_state{{state="closed",worker="{url}"}} 0.0' in metrics


def test_a_stream_past_the_whole_request_timeout_is_cut_with_an_error_event(make_stack):
    stack = make_stack(1, sim=SimConfig(decode_ms_per_token=100.0), upstream_timeout=1.0)
    started = time.monotonic()
    with stack.client.stream("POST", "/v1/completions", json={
            "prompt": words(0, 8), "max_tokens": 60, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - started < 5
    assert "data: [DONE]" not in lines
    assert json.loads(lines[-1][6:])["error"]["code"] == "worker_timeout"
    assert stack.gateway.workers.get(stack.fleet.urls[0]).inflight == 0


class StallingWorker(asyncio.Protocol):
    """Answers every request with headers and the first byte of a 100-byte body, then stalls."""

    open: ClassVar[set[StallingWorker]] = set()

    def connection_made(self, transport) -> None:
        self.transport = transport
        StallingWorker.open.add(self)

    def data_received(self, data: bytes) -> None:
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: 100\r\n\r\n{")

    def connection_lost(self, exc) -> None:
        StallingWorker.open.discard(self)


@contextlib.contextmanager
def gateway_before(loop_thread, worker: type[asyncio.Protocol], **config):
    """A gateway (health checks left to the test) in front of one `worker` protocol server."""
    async def listen():
        return await asyncio.get_running_loop().create_server(worker, "127.0.0.1", 0)

    listener = loop_thread.run(listen())
    port = listener.sockets[0].getsockname()[1]
    server = GatewayServer(GatewayConfig(worker_urls=(f"http://127.0.0.1:{port}",),
                                         host="127.0.0.1", port=0, health_interval=3600.0,
                                         **config))
    loop_thread.run(server.start())
    try:
        yield server
    finally:
        loop_thread.run(server.stop())
        loop_thread.call(listener.close)


def test_health_checks_that_time_out_mid_body_leave_no_connection_open(loop_thread):
    with gateway_before(loop_thread, StallingWorker, health_timeout=0.2) as server:
        worker = next(iter(server.gateway.workers))
        for _ in range(5):
            loop_thread.run(server.monitor.check(worker))
        # every timed-out check closed its connection (before: one leaked per check)
        assert wait_for(lambda: len(StallingWorker.open) == 0, 3), len(StallingWorker.open)


def test_a_long_request_on_a_worker_that_answers_others_leaves_its_breaker_closed(make_stack):
    # Every timeout was a breaker failure: a client's own long non-streamed generations (headers
    # come at the end) took healthy workers out for everyone.
    stack = make_stack(1, sim=SimConfig(decode_ms_per_token=100.0),
                       upstream_first_byte_timeout=1.0, breaker_failures=1)
    url = stack.fleet.urls[0]
    long_one: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: long_one.append(stack.client.post(
        "/v1/completions", json={"prompt": words(0, 8), "max_tokens": 60})))
    thread.start()
    time.sleep(0.2)
    short = stack.client.post("/v1/completions", json={"prompt": words(9, 8), "max_tokens": 1})
    thread.join(10)
    assert short.status_code == 200 and long_one[0].status_code == 504
    row = next(w for w in stack.client.get("/workers").json()["workers"] if w["url"] == url)
    assert row["circuit_breaker"] == "closed"
    metrics = stack.client.get("/metrics").text
    assert f'radixpool_gateway_upstream_timeouts_total{{worker="{url}"}} 1.0' in metrics
    assert f'radixpool_gateway_breaker_state{{state="closed",worker="{url}"}} 1.0' in metrics


def test_models_from_a_hung_worker_time_out(loop_thread):
    with gateway_before(loop_thread, StallingWorker, upstream_first_byte_timeout=0.5,
                        upstream_timeout=1.0) as server:
        started = time.monotonic()
        r = httpx.get(f"http://127.0.0.1:{server.port}/v1/models", timeout=10)
        assert r.status_code == 504 and time.monotonic() - started < 5
        assert r.json()["error"]["code"] == "worker_timeout"


def test_an_answer_whose_body_stalls_past_the_request_timeout_is_a_504_with_a_code(loop_thread):
    with gateway_before(loop_thread, StallingWorker, upstream_timeout=1.0) as server:
        r = httpx.post(f"http://127.0.0.1:{server.port}/v1/completions",
                       json={"prompt": "hi", "max_tokens": 1}, timeout=10)
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "worker_timeout"


def test_a_hung_worker_does_not_hold_up_the_other_models_list(make_stack, loop_thread):
    """A worker of another model hangs before its health checks notice: the model list still
    comes within the listing's own deadline, with the models of those that answered."""
    from radixpool.gateway.model_list import MODEL_LIST_TIMEOUT_S
    from radixpool.protocol.server_info import ServerInfo

    stack = make_stack(1, upstream_first_byte_timeout=60.0)
    listener = loop_thread.run(_listen())
    hung_url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    try:
        hung = loop_thread.call(stack.gateway.workers.add, hung_url)
        loop_thread.call(stack.gateway.workers.set_info, hung,
                         ServerInfo("other", "other-model", 4096, 4096, 1, 16, "i-1", "test"))
        started = time.monotonic()
        r = stack.client.get("/v1/models")
        took = time.monotonic() - started
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["sim-model"]
        assert took < MODEL_LIST_TIMEOUT_S + 3, took
    finally:
        loop_thread.call(listener.close)


class SilentWorker(asyncio.Protocol):
    """Takes every request and answers nothing, health checks included (a SIGSTOPped
    worker, as the gateway sees it)."""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        pass


def test_a_request_waiting_on_a_worker_found_hung_is_retried_at_once(make_stack, loop_thread):
    """A worker hangs with a request sent to it before its checks noticed: once they take it
    down (unanswered, not draining), that request goes to another worker at once instead of
    waiting out the 300 s first-byte deadline (the client has had nothing from the hung one)."""
    stack = make_stack(1, health_failures=2, health_timeout=0.2)
    good = stack.gateway.workers.get(stack.fleet.urls[0])
    listener = loop_thread.run(_listen(SilentWorker))
    hung_url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    try:
        def listed_and_seen_up():   # it answered a check before it hung (SIGSTOP)
            worker = stack.gateway.workers.add(hung_url)
            worker.health.record(True)
            return worker

        hung = loop_thread.call(listed_and_seen_up)
        assert wait_for(lambda: hung.health._run == 1, 5)   # its first check went unanswered
        good.draining = True   # the request can only go to the hung worker
        answer: list[httpx.Response] = []
        client = threading.Thread(target=lambda: answer.append(stack.client.post(
            "/v1/completions", json={"prompt": words(0, 10), "max_tokens": 2})))
        client.start()
        assert wait_for(lambda: hung.inflight == 1, 5)
        good.draining = False
        started = time.monotonic()
        loop_thread.run(stack.server.monitor.check(hung))   # the second unanswered check
        client.join(10)
        assert answer and answer[0].status_code == 200, answer
        assert answer[0].headers["x-radixpool-worker"] == good.url
        assert time.monotonic() - started < 3
        assert hung.inflight == 0 and not hung.health.healthy
    finally:
        loop_thread.call(listener.close)


def test_a_listed_worker_that_never_answers_is_down_from_its_first_check(loop_thread):
    """A gateway whose only worker is listed but silent (not up yet, a wrong address) is not
    ready: /health waits for a worker to pass a check, and the first unanswered check takes the
    worker down, not --health-failures of them (6 s by default), so requests get a clear 503."""
    listener = loop_thread.run(_listen(SilentWorker))
    url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    server = GatewayServer(GatewayConfig(host="127.0.0.1", port=0, worker_urls=(url,),
                                         health_interval=30.0, health_timeout=0.3))
    loop_thread.run(server.start())
    try:
        worker = server.gateway.workers.get(url)
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as client:
            r = client.get("/health")
            assert r.status_code == 503 and r.json()["eligible_workers"] == 0, r.text
            assert wait_for(lambda: not worker.health.healthy, 3)
            r = client.post("/v1/completions", json={"prompt": "w1", "max_tokens": 1})
            assert r.status_code == 503 and "no healthy worker" in r.json()["error"]["message"]
    finally:
        loop_thread.run(server.stop())
        loop_thread.call(listener.close)


def test_a_draining_worker_finishes_the_requests_it_holds(make_stack):
    """A worker whose checks answer 503 (draining) is taken down too, but it is answering: the
    requests it holds are not given up on, they finish there."""
    stack = make_stack(1, sim=SimConfig(decode_ms_per_token=300.0), health_failures=1)
    worker = stack.gateway.workers.get(stack.fleet.urls[0])
    answer: list[httpx.Response] = []
    client = threading.Thread(target=lambda: answer.append(stack.client.post(
        "/v1/completions", json={"prompt": words(0, 10), "max_tokens": 4})))
    client.start()
    assert wait_for(lambda: worker.inflight == 1, 5)
    stack.fleet.workers[0].fail_health = True
    stack.check_all()
    assert not worker.health.healthy
    client.join(10)
    assert answer and answer[0].status_code == 200
    assert answer[0].headers["x-radixpool-worker"] == worker.url


async def _listen(protocol: type[asyncio.Protocol] = StallingWorker):
    return await asyncio.get_running_loop().create_server(protocol, "127.0.0.1", 0)


class DroppingWorker(asyncio.Protocol):
    """Answers 200 while `dropping` is off; then closes each connection a request comes on."""

    dropping = False
    received = 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        DroppingWorker.received += 1
        if DroppingWorker.dropping:
            self.transport.close()
        else:
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")


def test_a_request_the_worker_drops_is_tried_once_more_not_once_per_idle_connection(
        loop_thread):
    # Each idle pooled connection was tried in turn: one request reached the failing worker 20
    # times before the client got its 502.
    from radixpool.gateway.upstream import UpstreamError, UpstreamPool

    async def scenario() -> int:
        server = await asyncio.get_running_loop().create_server(DroppingWorker, "127.0.0.1", 0)
        pool = UpstreamPool("127.0.0.1", server.sockets[0].getsockname()[1], 2.0)

        async def one() -> None:
            answer = await pool.request("GET", "/x")
            await answer.body()
            answer.release()

        await asyncio.gather(*(one() for _ in range(20)))   # 20 idle connections now
        DroppingWorker.dropping, DroppingWorker.received = True, 0
        with pytest.raises(UpstreamError):
            await pool.request("POST", "/v1/completions", body=b"{}")
        pool.close()
        server.close()
        return DroppingWorker.received

    assert loop_thread.run(scenario()) <= 2


def test_a_worker_url_with_a_bad_host_name_is_a_down_worker(make_stack):
    # An empty DNS label made the connection raise UnicodeError: requests routed there got 500s
    # (no retry), and the health check's task died, so it stayed eligible.
    stack = make_stack(1)
    bad = "http://worker-1.pool..svc:8000"
    stack.loop.call(stack.gateway.workers.add, bad)
    answers = [stack.client.post("/v1/completions", json={
        "prompt": words(10 * i, 8), "max_tokens": 1}).status_code for i in range(6)]
    assert answers == [200] * 6
    for _ in range(3):
        stack.check_all()
    row = next(w for w in stack.client.get("/workers").json()["workers"] if w["url"] == bad)
    assert not row["eligible"], row


class EarlyHintsWorker(asyncio.Protocol):
    """Answers each request with an interim `103 Early Hints` at once and the answer a moment
    later, as a worker behind a proxy that sends early hints would."""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>\r\n\r\n")
        asyncio.get_running_loop().call_later(0.1, self.transport.write, (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n"
            b'{"ok": "a"}'))


def test_an_interim_answer_is_not_taken_for_the_workers_answer(loop_thread):
    # The 103 was relayed as the answer: the client waited on for a final one that never came,
    # and the worker's real answer was left on a pooled connection for the next request.
    with gateway_before(loop_thread, EarlyHintsWorker) as server, \
            httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=5) as client:
        for _ in range(2):
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert r.status_code == 200 and r.json() == {"ok": "a"}


class OddStatusWorker(asyncio.Protocol):
    """Passes its health checks and answers every other request with `status`."""

    status = b"999 Odd"

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        status = b"200 OK" if data.startswith(b"GET /health ") else self.status
        self.transport.write(b"HTTP/1.1 %s\r\ncontent-length: 2\r\n\r\nok" % status)


@pytest.mark.parametrize("status", [b"999 Odd", b"000 None", b"101 Switching Protocols"])
def test_a_worker_answering_no_http_status_is_a_502_not_a_dropped_connection(loop_thread,
                                                                             status):
    # The gateway had no status line for 999 (or 000): its handler failed after the answer had
    # begun, and the client's connection was dropped with no answer at all.
    OddStatusWorker.status = status
    with gateway_before(loop_thread, OddStatusWorker) as server, \
            httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=5) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 502, r.text
        assert f"status {int(status[:3])}" in r.json()["error"]["message"]
        assert client.get("/livez").status_code == 200


class MeshedWorker(asyncio.Protocol):
    """A worker behind a service-mesh sidecar that resolves dot segments in paths (Istio's
    default path normalization, RFC 3986, backslashes read as slashes) before the worker routes
    them; its control path answers whoever presents the control key."""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        target = data.split(b" ", 2)[1].decode()
        path = posixpath.normpath(unquote(target).replace("\\", "/"))
        if path == "/kv_events/snapshot" and b"authorization: Bearer control-key" in data:
            body = b'{"blocks": "every prompt cached here"}'
        elif path == "/health":
            body = b'{"status": "ok"}'
        else:
            body = b'{"id": "sim-model", "object": "model"}'
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))


@pytest.mark.parametrize("model", ["../../kv_events/snapshot", "..%2F..%2Fkv_events%2Fsnapshot",
                                   "..%5C..%5Ckv_events%5Csnapshot"])
def test_a_model_id_that_climbs_out_of_the_models_path_reaches_no_worker(loop_thread, model):
    # /v1/models/{id} went to a worker with the gateway's worker (control) key: where a sidecar
    # resolved the dot segments, a client holding only the serving key read /kv_events/snapshot.
    with gateway_before(loop_thread, MeshedWorker, api_key="client-key",
                        worker_api_key="control-key") as server:
        def get(model: str) -> tuple[int, dict, dict]:
            client = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
            try:   # as sent (`curl --path-as-is`): httpx resolves dot segments itself
                client.request("GET", f"/v1/models/{model}",
                               headers={"authorization": "Bearer client-key"})
                r = client.getresponse()
                return r.status, dict(r.getheaders()), json.loads(r.read())
            finally:
                client.close()

        status, headers, doc = get(model)
        assert status == 404, doc
        assert doc["error"]["code"] == "model_not_found"
        assert "x-radixpool-worker" not in headers
        status, _, doc = get("sim-model")
        assert status == 200 and doc["id"] == "sim-model"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_with_a_request_pipelined_cancels_the_one_being_answered(
        make_stack, stream):
    # uvicorn marks only the connection's newest request (the pipelined one, not yet started)
    # as disconnected: the request being answered never learned its client had gone, kept its
    # worker busy to the end, and then failed writing to the closed connection (a traceback in
    # the log for every such client).
    stack = make_stack(1, sim=SimConfig(prefill_us_per_token=200_000.0), kv_events=False)
    worker = stack.fleet.workers[0]
    body = json.dumps({"prompt": words(0, 30), "max_tokens": 60, "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", stack.server.port)) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
                  + b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
        assert wait_for(lambda: worker.running == 1, 5)   # the worker is on it
        in_flight_connections = len(worker.connections)
    # the gateway closed its connection to the worker (which aborts there) and let go
    assert wait_for(lambda: stack.gateway.workers.get(worker.url).inflight == 0, 3)
    assert wait_for(lambda: len(worker.connections) < in_flight_connections, 3)
    assert dict(stack.gateway.metrics.requests) == {(worker.url, "499"): 1}


def test_a_worker_at_its_connection_limit_is_busy_not_broken(loop_thread, monkeypatch):
    # A worker holding its --max-connections answers a new connection's 503 at once, before the
    # request is sent. The gateway cleared that answer as it sent the request and then read
    # "worker closed the connection": a client's request got 502, and the health checks found
    # the worker unanswering, took it down and gave up the requests it was answering (as hung)
    # where it was only busy.
    from radixpool.gateway.http_edge import EdgeLimits, EdgeServer
    from radixpool.gateway.upstream import UpstreamPool

    connect = UpstreamPool._connect

    async def connect_then_other_work(pool):   # the refusal is in before the request goes
        conn = await connect(pool)
        await asyncio.sleep(0.05)
        return conn

    monkeypatch.setattr(UpstreamPool, "_connect", connect_then_other_work)

    release = loop_thread.run(_event())

    async def app(request, respond) -> None:
        if b"hold" in request.body:
            await release.wait()
        await respond.send(200, [(b"content-type", b"application/json")], b'{"ok": true}')

    worker = EdgeServer(app, "127.0.0.1", 0, EdgeLimits(max_connections=1))
    loop_thread.run(worker.start())
    url = f"http://127.0.0.1:{worker.port}"
    server = GatewayServer(GatewayConfig(worker_urls=(url,), host="127.0.0.1", port=0,
                                         health_interval=3600.0))
    loop_thread.run(server.start())
    state = server.gateway.workers.get(url)
    held: list[httpx.Response] = []

    def send(prompt: str) -> httpx.Response:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as client:
            return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})

    holder = threading.Thread(target=lambda: held.append(send("hold")))
    try:
        assert wait_for(lambda: state.health.proven and not worker._state.tasks, 5)
        holder.start()   # through the gateway: its connection is the worker's one
        assert wait_for(lambda: len(worker._state.tasks) == 1, 5)

        async def ask_directly() -> list[tuple[int, dict]]:
            pool = UpstreamPool("127.0.0.1", worker.port, 2.0)
            try:
                answers = []
                for _ in range(5):
                    answer = await pool.request("POST", "/v1/completions", body=b"{}")
                    answers.append((answer.status, json.loads(await answer.body())))
                return answers
            finally:
                pool.close()

        for status, doc in loop_thread.run(ask_directly()):
            assert status == 503 and doc["error"]["code"] == "too_many_connections", doc
        r = send("another")
        assert r.status_code == 503, r.text
        assert "503 (draining or overloaded)" in r.json()["error"]["message"]
        for _ in range(4):   # more than health_failures checks
            loop_thread.run(server.monitor.check(state))
        assert state.draining and state.health_failure == {"status": 503,
                                                           "code": "too_many_connections"}
        loop_thread.call(release.set)
        holder.join(10)
        assert held and held[0].status_code == 200 and held[0].json() == {"ok": True}
    finally:
        loop_thread.call(release.set)
        holder.join(10) if holder.is_alive() else None
        loop_thread.run(server.stop())
        loop_thread.run(worker.stop())


async def _event() -> asyncio.Event:
    return asyncio.Event()


class LateEndingStreamWorker(asyncio.Protocol):
    """Streams a whole answer (its text, its usage, `[DONE]`) at once, and the chunk that ends
    the HTTP body a second later."""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        events = [{"id": "c", "object": "text_completion", "created": 0, "model": "m",
                   "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]},
                  {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                   "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1,
                                            "total_tokens": 6,
                                            "prompt_tokens_details": {"cached_tokens": 3}}}]
        body = b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in events)
        body += b"data: [DONE]\n\n"
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(body), body))
        asyncio.get_running_loop().call_later(1.0, self.transport.write, b"0\r\n\r\n")


def test_a_stream_the_client_hangs_up_on_after_done_is_counted_as_answered(loop_thread):
    # The openai SDKs close the response as soon as they read `[DONE]`. The gateway was still
    # waiting for the worker's end of the body, took the hang-up for a client leaving mid-answer
    # and counted a whole answer as a 499, its usage lost to the hit rates.
    import openai

    with gateway_before(loop_thread, LateEndingStreamWorker) as server:
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                            max_retries=0, timeout=5)
        chunks = list(sdk.completions.create(model="m", prompt="hi", max_tokens=1, stream=True))
        assert [c.choices[0].text for c in chunks] == ["hi"]
        gateway = server.gateway
        url = gateway.config.worker_urls[0]
        assert wait_for(lambda: gateway.metrics.requests, 10)
        assert dict(gateway.metrics.requests) == {(url, "200"): 1}
        worker = gateway.workers.get(url)
        assert (worker.requests, worker.prompt_tokens, worker.cached_tokens) == (1, 5, 3)


class FreezingStreamWorker(asyncio.Protocol):
    """Passes its health checks until it answers a request with the start of a stream, one
    event; then freezes: nothing more, health checks included (a worker SIGSTOPped, or its node
    cut off, mid-stream)."""

    frozen = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if FreezingStreamWorker.frozen:
            return
        if data.startswith(b"GET "):
            status = b"200 OK" if data.startswith(b"GET /health ") else b"404 Not Found"
            self.transport.write(b"HTTP/1.1 %s\r\ncontent-length: 0\r\n\r\n" % status)
        else:
            FreezingStreamWorker.frozen = True
            event = b'data: {"choices": [{"index": 0, "text": "hi", "finish_reason": null}]}\n\n'
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n"
                                 % (len(event), event))


def test_a_stream_from_a_worker_found_hung_is_cut_with_an_error_event(loop_thread):
    # A stream whose worker froze mid-answer (no reset: SIGSTOP, a node cut off) hung its client
    # until --upstream-timeout (30 min by default), though the health checks had found the worker
    # hung within seconds: only requests still waiting for their headers were given up.
    with gateway_before(loop_thread, FreezingStreamWorker, health_timeout=0.3,
                        health_failures=2) as server, \
            httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=15) as client:
        worker = server.gateway.workers.get(server.gateway.config.worker_urls[0])
        assert wait_for(lambda: worker.health.proven, 5)   # up before it froze
        with client.stream("POST", "/v1/completions", json={
                "prompt": "hi", "max_tokens": 60, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")) \
                .startswith('data: {"choices"')
            started = time.monotonic()
            for _ in range(2):   # two unanswered checks: the worker is down, found hung
                loop_thread.run(server.monitor.check(worker))
            last = [line for line in lines if line.startswith("data: ")][-1]
        assert time.monotonic() - started < 10
        error = json.loads(last[6:])["error"]
        assert error["code"] == "worker_failed" and "health checks" in error["message"]
        assert wait_for(lambda: worker.inflight == 0, 5)


def test_a_request_whose_client_leaves_as_its_worker_connection_opens_is_not_sent():
    # Before: asyncio.wait_for swallowed (Python 3.11) a cancellation that came as the
    # connection opened: the request went to the worker for a client already gone, and the
    # gateway counted its answer as delivered.
    from radixpool.gateway.upstream import UpstreamPool

    async def scenario() -> tuple[str, list[bytes]]:
        received: list[bytes] = []

        async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if data := await reader.read(65536):
                received.append(data)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            writer.close()

        server = await asyncio.start_server(worker, "127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        opened = loop.create_future()
        real_open = loop.create_connection

        async def open_then_wait(*args, **kwargs):
            connection = await real_open(*args, **kwargs)
            gate = loop.create_future()
            opened.set_result(gate)
            await gate
            return connection

        loop.create_connection = open_then_wait
        pool = UpstreamPool("127.0.0.1", server.sockets[0].getsockname()[1], 5.0)
        request = asyncio.create_task(pool.request("POST", "/generate", body=b"{}"))
        gate = await opened
        gate.set_result(None)   # the connection opens ...
        request.cancel()        # ... as the client leaves
        try:
            await request
            outcome = "sent"
        except asyncio.CancelledError:
            outcome = "given up"
        await asyncio.sleep(0.2)   # time for a request that did go out to arrive
        server.close()
        return outcome, received

    outcome, received = asyncio.run(scenario())
    assert outcome == "given up" and received == []
