"""Real `radixpool worker` processes on loopback ports, with the tiny model.

Servers, each started once per session and only if a collected test needs it:
- `worker`: default flags, shared by every test that neither stops nor reconfigures it;
- `secured`: `--api-key`, for the auth tests and the SIGTERM drain (which ends it);
- `fuzz_worker`: a 32-token context, so fuzzed generations stay short on a CPU;
- `impatient`: a 0.5 s drain timeout, to see requests cut short by a drain;
- `doomed`: default flags, for the test that kills its engine core;
- `frozen`: a 2 s `--watchdog-timeout`, for the test that stops its engine core;
- `polled`: default flags, SIGTERMed with a `/kv_events` long poll open;
- `slow_prefill`: 8-token prefill chunks and pages (long prompts take seconds to a first
  token), and KV for 1,600 tokens, less than the 2,048-token context;
- `edge`: 0.5 s header and body read timeouts and a 1 s write stall timeout, for the
  HTTP edge's limits;
- `templated`: the tiny model with a 65,536-token context and a chat template that prints the
  `preamble` template variable (`chat_template_kwargs`).
They are launched together (startup is mostly waiting on imports and model loading) and stopped
together, each by its own PID.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from worker_process import API_KEY, WorkerProcess

SERVERS: dict[str, tuple[str, ...]] = {
    "worker": (),
    # a drain ends when its streams do: the long bound only keeps a slow, loaded machine (a
    # 1,500-token stream took over 60 s at a load of 5 on 2 cores) from cutting the stream
    "secured": ("--api-key", API_KEY, "--drain-timeout", "300"),
    "fuzz_worker": ("--context-length", "32", "--max-running-requests", "32"),
    # two running at most: a third request waits, to be cut by the drain before it starts
    "impatient": ("--drain-timeout", "0.5", "--max-running-requests", "2"),
    "doomed": (),
    "frozen": ("--watchdog-timeout", "2"),
    "polled": (),
    "slow_prefill": ("--chunked-prefill-size", "8", "--max-prefill-tokens", "8",
                     "--page-size", "8", "--kv-cache-tokens", "1600"),
    "edge": ("--header-read-timeout", "0.5", "--body-read-timeout", "0.5",
             "--write-stall-timeout", "1"),
    "templated": (),
}


@pytest.fixture(scope="session")
def templated_model(tiny_model, tmp_path_factory):
    model = tmp_path_factory.mktemp("templated") / "model"
    shutil.copytree(tiny_model, model)
    for name, edit in (
            ("tokenizer_config.json", lambda c: c.update(
                chat_template="{{ preamble or '' }}" + c["chat_template"])),
            ("config.json", lambda c: c.update(max_position_embeddings=65536))):
        doc = json.loads((model / name).read_text())
        edit(doc)
        (model / name).write_text(json.dumps(doc))
    return model


@pytest.fixture(scope="session")
def worker_pool(request, tiny_model, tmp_path_factory):
    needed = [name for name in SERVERS
              if any(name in item.fixturenames for item in request.session.items)]
    logs = tmp_path_factory.mktemp("workers")
    models = {name: tiny_model for name in needed}
    if "templated" in needed:
        models["templated"] = request.getfixturevalue("templated_model")
    procs = {name: WorkerProcess(models[name], logs / f"{name}.log", *SERVERS[name])
             for name in needed}
    try:
        yield procs
    finally:
        for proc in procs.values():
            proc.begin_stop()
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="session")
def worker(worker_pool) -> WorkerProcess:
    return worker_pool["worker"].wait_ready()


@pytest.fixture(scope="session")
def secured(worker_pool) -> WorkerProcess:
    return worker_pool["secured"].wait_ready()


@pytest.fixture(scope="session")
def fuzz_worker(worker_pool) -> WorkerProcess:
    return worker_pool["fuzz_worker"].wait_ready()


@pytest.fixture(scope="session")
def impatient(worker_pool) -> WorkerProcess:
    return worker_pool["impatient"].wait_ready()


@pytest.fixture(scope="session")
def doomed(worker_pool) -> WorkerProcess:
    return worker_pool["doomed"].wait_ready()


@pytest.fixture(scope="session")
def frozen(worker_pool) -> WorkerProcess:
    return worker_pool["frozen"].wait_ready()


@pytest.fixture(scope="session")
def polled(worker_pool) -> WorkerProcess:
    return worker_pool["polled"].wait_ready()


@pytest.fixture(scope="session")
def slow_prefill(worker_pool) -> WorkerProcess:
    return worker_pool["slow_prefill"].wait_ready()


@pytest.fixture(scope="session")
def edge(worker_pool) -> WorkerProcess:
    return worker_pool["edge"].wait_ready()


@pytest.fixture(scope="session")
def templated(worker_pool) -> WorkerProcess:
    return worker_pool["templated"].wait_ready()


@pytest.fixture(scope="session")
def client(worker):
    from openai import OpenAI

    return OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(worker):
    with httpx.Client(base_url=worker.url, timeout=120) as c:
        yield c
