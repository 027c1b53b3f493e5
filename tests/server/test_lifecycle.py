"""API key, client disconnects, draining on SIGTERM and a crashed engine core — against real
worker processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from worker_process import API_KEY as KEY
from worker_process import WorkerProcess, free_port

pytestmark = pytest.mark.slow
CORE_DEATH_EXIT_S = 10


def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_api_key_protects_everything_but_health_livez_and_metrics(secured):
    url = secured.url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/livez").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    for path in ("/v1/models", "/server_info", "/load", "/tokenizer", "/kv_events/snapshot"):
        r = httpx.get(f"{url}{path}")
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(f"{url}{path}", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401, path
        assert httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {KEY}"}
                         ).status_code == 200, path
    # either header, with spaces after the value (a hand-made request, raw: httpx refuses to
    # send them), as the gateway takes it: an X-API-Key with a trailing space got 401 here
    host, port = url.removeprefix("http://").rsplit(":", 1)
    for header in (f"Authorization: Bearer  {KEY} ", f"X-API-Key: {KEY} \t"):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(f"GET /server_info HTTP/1.1\r\nhost: x\r\n{header}\r\n"
                         "connection: close\r\n\r\n".encode())
            assert sock.recv(64).startswith(b"HTTP/1.1 200"), header
    # the key came as a flag: the worker says it shows in the process list, as the gateway does
    assert "--api-key puts the serving key in the process list" in secured.log()
    assert httpx.post(f"{url}/generate", json={"text": "x"}).status_code == 401
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2)
    assert r.choices[0].message.content is not None
    bad = OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(Exception, match="401"):
        bad.models.list()


def _streaming(url: str, key: str, prompt: str) -> tuple[threading.Thread, list]:
    """A 1,500-token completion streaming in a thread (long enough to still be running when a
    signal lands, even on an idle fast machine), once its first chunk has arrived."""
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)
    started = threading.Event()
    chunks: list = []

    def stream() -> None:
        for chunk in client.completions.create(model="tiny", prompt=prompt, stream=True,
                                               max_tokens=1500, temperature=0,
                                               extra_body={"ignore_eos": True},
                                               stream_options={"include_usage": True}):
            chunks.append(chunk)
            started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    return thread, chunks


def test_sigterm_drains_running_requests_then_exits_zero(secured):
    headers = {"Authorization": f"Bearer {KEY}"}
    thread, chunks = _streaming(secured.url, KEY, "drain me")
    secured.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(f"{secured.url}/health").status_code == 503,
               what="/health to turn 503")
    r = httpx.post(f"{secured.url}/v1/completions", headers=headers,
                   json={"model": "tiny", "prompt": "too late", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["code"] == "draining"
    thread.join(300)
    assert chunks[-1].usage.completion_tokens == 1500
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert secured.proc.wait(60) == 0
    assert "draining" in secured.log()


def test_drain_timeout_ends_running_streams_cleanly(impatient):
    """Past the drain timeout a stream ends with finish_reason "abort" and its usage; a whole
    answer is a 503 `draining`, so a gateway (or the SDK) sends it again elsewhere instead of
    passing on a truncated text as if it were done. So is a stream still waiting to start: it
    has sent nothing, and a 200 ending in "abort" could not be sent again."""
    whole: list[httpx.Response] = []
    asked = threading.Thread(target=lambda: whole.append(httpx.post(
        f"{impatient.url}/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": "too long as well", "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True})))
    asked.start()
    thread, chunks = _streaming(impatient.url, "unused", "too long")
    metrics = httpx.Client(base_url=impatient.url)
    wait_until(lambda: _metric(metrics, "radixpool_num_requests_running") >= 2,
               what="both to run")
    waiting: list[httpx.Response] = []
    queued = threading.Thread(target=lambda: waiting.append(httpx.post(
        f"{impatient.url}/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": "waiting", "max_tokens": 8, "stream": True})))
    queued.start()
    wait_until(lambda: _metric(metrics, "radixpool_num_requests_waiting") >= 1,
               what="a third to wait")
    impatient.proc.send_signal(signal.SIGTERM)
    thread.join(300)
    asked.join(300)
    queued.join(300)
    assert waiting and waiting[0].status_code == 503, waiting and waiting[0].text
    assert waiting[0].json()["error"]["code"] == "draining"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "abort"
    assert chunks[-1].usage.completion_tokens < 1500   # the stream ended properly, with usage
    assert whole and whole[0].status_code == 503, whole and whole[0].text
    assert whole[0].json()["error"]["code"] == "draining" and whole[0].headers["retry-after"]
    assert impatient.proc.wait(60) == 0


def _leave_a_long_stream(url: str, events: int, while_open=lambda: None) -> None:
    """Stream a 1,500-token completion and hang up after `events` SSE events; `while_open` runs
    just before (leaving the event loop closes the connection)."""
    body = {"model": "tiny", "prompt": "never mind", "max_tokens": 1500, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= events:
                while_open()
                break


def test_disconnected_stream_is_aborted_and_frees_its_kv(worker, http):
    aborted_before = _abort_count(http)

    def one_running() -> None:
        assert http.get("/load").json()["running"] == 1

    _leave_a_long_stream(worker.url, 3, one_running)
    wait_until(lambda: _abort_count(http) == aborted_before + 1, what="the request's abort")
    # the server counts the abort as it sends it; the engine core ends the request just after
    wait_until(lambda: (lambda load: (load["running"], load["waiting"]) == (0, 0))(
        http.get("/load").json()), timeout_s=10, what="the engine to end the request")
    # nothing holds KV any more: a flush (refused while any request runs) leaves none in use
    assert http.post("/flush_cache").status_code == 200
    load = http.get("/load").json()
    assert (load["running"], load["waiting"], load["kv_usage"]) == (0, 0, 0)


def _metric(http, sample: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _abort_count(http) -> float:
    return _metric(http, 'radixpool_requests_total{finish_reason="abort"}')


def test_an_aborted_streams_tokens_are_counted(worker, http):
    before = {name: _metric(http, name) for name in (
        "radixpool_generation_tokens_total", "radixpool_prompt_tokens_total")}
    aborted_before = _abort_count(http)
    _leave_a_long_stream(worker.url, 20)
    wait_until(lambda: _abort_count(http) == aborted_before + 1, what="the request's abort")
    generated = _metric(http, "radixpool_generation_tokens_total") - before[
        "radixpool_generation_tokens_total"]
    assert 20 <= generated < 1500   # what it made before the client left, not 0
    assert _metric(http, "radixpool_prompt_tokens_total") > before[
        "radixpool_prompt_tokens_total"]


def test_disconnected_non_streaming_request_is_aborted(worker, http):
    aborted_before = _abort_count(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{worker.url}/v1/completions", timeout=1.0,
                   json={"prompt": "never mind", "max_tokens": 1500, "ignore_eos": True})
    wait_until(lambda: _abort_count(http) == aborted_before + 1, what="the request's abort")


def test_a_disconnected_batch_of_prompts_aborts_and_counts_each_of_them(worker, http):
    # The batch was collected one prompt at a time: the client leaving cancelled the first
    # prompt's collection only, and the others were never closed (nor counted).
    aborted_before = _abort_count(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{worker.url}/v1/completions", timeout=1.0,
                   json={"prompt": ["never mind", "forget it", "not now"], "n": 2,
                         "max_tokens": 1500, "ignore_eos": True})
    wait_until(lambda: _abort_count(http) == aborted_before + 6, what="six aborts")
    wait_until(lambda: http.get("/load").json()["running"] == 0, what="nothing running")
    time.sleep(0.5)
    assert _abort_count(http) == aborted_before + 6   # and no more


def test_clients_that_leave_before_their_first_token_are_aborted(slow_prefill):
    # The disconnect watch began at the first token: prompts whose clients had left were
    # still prefilled, one after the other, for seconds.
    url = slow_prefill.url
    aborted_before = _metric(httpx.Client(base_url=url), 'radixpool_requests_total'
                             '{finish_reason="abort"}')
    prompts = [[7 + (13 * i + j) % 900 for j in range(1500)] for i in range(6)]
    bodies = [("/generate", {"input_ids": prompts[0], "stream": True}),
              ("/generate", {"input_ids": prompts[1]}),
              ("/v1/completions", {"prompt": prompts[2], "stream": True}),
              ("/v1/completions", {"prompt": prompts[3]}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w " * 1400}],
                                        "stream": True}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w " * 1450}]})]
    outcomes: list[str] = []

    def leave_early(path: str, body: dict) -> None:
        try:
            # 0.2 s: well inside the first prompt's own prefill (188 steps of 8 tokens, 0.4 s
            # on a fast 2-vCPU VM; with 0.5 s it was sometimes answered)
            with httpx.Client(base_url=url, timeout=httpx.Timeout(60, read=0.2)) as c, \
                    c.stream("POST", path, json={**body, "max_tokens": 50}
                             if path != "/generate" else body) as r:
                r.read()
                outcomes.append(f"{path} answered {r.status_code} {r.text[:200]}")
        except httpx.ReadTimeout:
            outcomes.append("left")

    threads = [threading.Thread(target=leave_early, args=b) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    gone = time.monotonic()
    assert outcomes == ["left"] * 6, outcomes
    with httpx.Client(base_url=url) as http:
        wait_until(lambda: _abort_count(http) == aborted_before + 6, timeout_s=10,
                   what="six aborts")
        wait_until(lambda: (lambda load: load["running"] + load["waiting"] == 0)(
            http.get("/load").json()), timeout_s=10, what="the engine to stop")
        # prefilling what was left takes seconds here (2 s on a 2-vCPU machine)
        assert time.monotonic() - gone < 1.5
        # nothing was left half-made: the worker serves the next request
        assert http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 2}}).status_code == 200


def core_of(worker) -> int:
    """The worker's engine core process (started from a thread: every task's children)."""
    children = [c for task in Path(f"/proc/{worker.pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    assert len(children) == 1, children
    return int(children[0])


@pytest.mark.parametrize("fault", ["crash", "stuck"])
def test_a_dead_or_stuck_engine_core_makes_the_worker_exit_nonzero_within_seconds(
        fault, doomed, frozen):
    # stuck: a core stuck in a step (a hung GPU; here SIGSTOP) left its requests hanging and
    # the worker's /health at 200, so nothing restarted it; `--watchdog-timeout` (2 s here)
    # now kills it, and the worker ends as it does when its core crashes.
    worker = doomed if fault == "crash" else frozen
    core = core_of(worker)
    body = {"model": "tiny", "prompt": "long", "max_tokens": 1500, "ignore_eos": True}
    with httpx.Client(base_url=worker.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/livez").status_code == 200
        running = threading.Thread(target=lambda: results.append(
            http.post("/v1/completions", json=body)))
        results: list[httpx.Response] = []
        running.start()
        time.sleep(0.5)
        os.kill(core, signal.SIGKILL if fault == "crash" else signal.SIGSTOP)
        killed = time.monotonic()
        running.join(60)
    # ended with a 503 a gateway retries elsewhere, not hung, before the worker went away
    assert results and results[0].status_code == 503, results
    assert "died" in results[0].json()["error"]["message"]
    # the code tells a gateway the engine died holding this request (twice: a query of death)
    assert results[0].json()["error"]["code"] == "engine_core_died"
    assert results[0].headers["retry-after"]
    code = worker.proc.wait(CORE_DEATH_EXIT_S)   # so the container is restarted
    assert code != 0 and time.monotonic() - killed < CORE_DEATH_EXIT_S
    assert ("the engine core process died (exit code -9)" if fault == "crash" else
            "the engine core made no progress for 2 s with requests in flight "
            "(--watchdog-timeout 2); it was killed") in worker.log()


def test_sigterm_with_a_kv_events_long_poll_open_exits_quietly(polled):
    seq = httpx.get(f"{polled.url}/kv_events/snapshot").json()["seq"]
    answers: list[httpx.Response] = []
    poll = threading.Thread(target=lambda: answers.append(httpx.get(
        f"{polled.url}/kv_events", params={"since": seq, "timeout": 60}, timeout=90)))
    poll.start()
    time.sleep(1.0)   # the poll is waiting for events that will not come
    polled.proc.send_signal(signal.SIGTERM)
    poll.join(30)
    assert answers and answers[0].status_code == 200, answers   # answered, not cut off
    assert answers[0].json()["events"] == [] and answers[0].json()["next"] == seq
    assert polled.proc.wait(60) == 0
    log = polled.log()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]


@pytest.mark.parametrize("flags, says", [
    (("--device", "cpu", "--context-length", "1", "--page-size", "8"),
     "KV cache of 4 tokens is smaller than one page (8 tokens)"),
    (("--context-length", "100000",),
     "may only shrink the model's context (2048 tokens: config.json max_position_embeddings)"),
    # more than the host holds: the pool's pages are touched only as the cache fills, so it
    # started, and the worker would have been killed for memory once the cache grew
    # (in the worker's flags, not the engine's field names)
    (("--device", "cpu", "--kv-cache-tokens", "100000000000"),
     "GiB that the host's available memory leaves: set --kv-cache-tokens to at most"),
    # the per-request tensors alone: the allocator's error, or a start that is killed later
    (("--device", "cpu", "--max-running-requests", "10000000"),
     "holds no KV page (0.000 GiB) after per-request tensors (--max-running-requests, "
     "--context-length)"),
])
def test_settings_the_engine_cannot_run_with_end_the_worker_with_one_line(tiny_model, flags,
                                                                          says):
    # They were reported with the engine core's traceback, as if the worker had crashed.
    done = subprocess.run([sys.executable, "-m", "radixpool.cli", "worker", "--model",
                           str(tiny_model), "--port", "0", *flags], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and says in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr



def test_sigterm_while_the_model_loads_stops_the_worker_and_its_core_at_once(tiny_model,
                                                                           tmp_path):
    """A pod deleted while its worker loads (a rollout replaced, a scale-down): the worker
    waited for the load to finish (up to --startup-timeout) before it could exit, so the kubelet
    killed it at the end of the grace period with the GPU held all that time."""
    model = tmp_path / "model"
    model.mkdir()
    for item in tiny_model.iterdir():
        if item.suffix != ".safetensors":
            (model / item.name).symlink_to(item)
    os.mkfifo(model / "model.safetensors")   # reading the weights blocks until we say so
    port = free_port()
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "radixpool.cli", "worker", "--model",
                                 str(model), "--port", str(port), "--device", "cpu",
                                 "--kv-cache-tokens", "2048"], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ,
                                                               "HF_HUB_OFFLINE": "1"})
    try:
        def loading():
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            except httpx.TransportError:
                return False
            return r.status_code == 503 and r.json()["status"] == "loading"

        wait_until(loading, 120, "the worker to serve /health while loading")

        def core() -> int | None:
            children = [c for task in Path(f"/proc/{proc.pid}/task").iterdir()
                        for c in (task / "children").read_text().split()]
            return int(children[0]) if children else None

        core_pid = wait_until(core, 120, "the engine core process")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        # the core, stuck reading the weights, went with it
        wait_until(lambda: not Path(f"/proc/{core_pid}").exists()
                   or "Z" in Path(f"/proc/{core_pid}/stat").read_text().split()[2], 30,
                   "the engine core to exit")
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # release a core left behind (old code) from its blocking open
        with contextlib.suppress(OSError):
            fd = os.open(model / "model.safetensors", os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)


def test_the_engine_core_logs_at_the_workers_log_level(tiny_model, tmp_path):
    """--log-level (a pool's engine.logLevel) stopped at the front end: the engine core, a
    process of its own, logged its INFO lines at any level asked, in another format."""
    worker = WorkerProcess(tiny_model, tmp_path / "worker.log", "--log-level", "warning")
    try:
        worker.wait_ready()
    finally:
        worker.stop()
    log = worker.log()
    assert "radixpool.worker.model_runner" not in log and "warm-up:" not in log, log[-2000:]
    info = WorkerProcess(tiny_model, tmp_path / "info.log", "--log-level", "info")
    try:
        info.wait_ready()
    finally:
        info.stop()
    assert " INFO radixpool.core: warm-up: " in info.log(), info.log()[-2000:]
