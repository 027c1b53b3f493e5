"""A real worker with `--host ::` (what the operator runs in pods) answers on IPv6 and IPv4, and a
real gateway in front reaches it as `http://[::1]:PORT`: an OpenAI SDK call goes through."""

from __future__ import annotations

import httpx
import openai
import pytest
from worker_process import STARTUP_TIMEOUT_S, WorkerProcess

from radixpool.fleet.process import ChildProcess, free_port, radixpool_argv
from tests.ipv6_loopback import ipv6_loopback_missing

pytestmark = pytest.mark.skipif(ipv6_loopback_missing() is not None,
                                reason=str(ipv6_loopback_missing()))


@pytest.fixture(scope="module")
def dual_stack_worker(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("ipv6")
    worker = WorkerProcess(tiny_model, logs / "worker.log", "--host", "::")
    worker.url = f"http://[::1]:{worker.port}"   # probed over IPv6; IPv4 is asserted below
    try:
        yield worker.wait_ready()
    finally:
        worker.stop()


def test_worker_on_all_addresses_answers_ipv4_and_ipv6(dual_stack_worker):
    """uvicorn bound `::` IPv6-only (asyncio sets IPV6_V6ONLY): a dual-stack pod's IPv4 probes
    and peers were refused."""
    port = dual_stack_worker.port
    for base in (f"http://[::1]:{port}", f"http://127.0.0.1:{port}"):
        assert httpx.get(base + "/health", timeout=30).status_code == 200, base
    assert f"http://[::]:{port}" in dual_stack_worker.log()   # its start-up line names it


def test_gateway_reaches_the_worker_at_a_bracketed_ipv6_url(dual_stack_worker, tmp_path):
    worker_url = f"http://[::1]:{dual_stack_worker.port}"
    port = free_port()
    gateway = ChildProcess("gateway", radixpool_argv(
        "gateway", "--worker-urls", worker_url, "--host", "::", "--port", str(port),
        "--health-interval", "0.5"), port, tmp_path / "gateway.log", host="::1")
    assert gateway.url == f"http://[::1]:{port}"
    gateway.start()
    try:
        gateway.wait_ready(STARTUP_TIMEOUT_S)
        listed = httpx.get(gateway.url + "/workers", timeout=30).json()["workers"]
        assert [w["url"] for w in listed] == [worker_url]
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
        assert reply.headers["x-radixpool-worker"] == worker_url
        assert reply.parse().usage.completion_tokens >= 1
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
    finally:
        gateway.stop(30)
