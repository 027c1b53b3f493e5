"""Real `radixpool worker` processes on loopback ports, with the tiny model.

`worker` is one server shared by every test that does not stop or reconfigure it; tests that need
their own flags (drain, API key, fuzzing with a small context) start their own. Each process is
stopped by its own PID, never by name.
"""

from __future__ import annotations

import httpx
import pytest
from worker_process import WorkerProcess


@pytest.fixture(scope="session")
def worker(tiny_model, tmp_path_factory):
    """The shared server: default flags, the tiny llama model."""
    proc = WorkerProcess(tiny_model, tmp_path_factory.mktemp("worker") / "worker.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def client(worker):
    from openai import OpenAI

    return OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(worker):
    with httpx.Client(base_url=worker.url, timeout=120) as c:
        yield c
