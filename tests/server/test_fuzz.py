"""Schemathesis fuzzes every operation of the worker's OpenAPI schema, with valid and invalid
data: never a 5xx, and the server keeps serving. The `fuzz_worker` has a 32-token context, so
fuzzed generations stay short on a CPU. The same cases also go through a real `radixpool
gateway` in front of it: the gateway reads every body to route it (model, prompt, messages,
input ids), so whatever the worker refuses with a 4xx must reach the client as that 4xx, and
whatever it serves must be served, never a 5xx of the gateway's own."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from radixpool.fleet.process import ChildProcess, free_port, radixpool_argv

pytestmark = pytest.mark.slow

EXAMPLES = 25
# Valid long polls only make the run slow (invalid ones are fuzzed in the negative mode).
SKIP_POSITIVE = {"/kv_events"}


@pytest.fixture(scope="module")
def fuzz_gateway(fuzz_worker, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("fuzz-gateway") / "gateway.log"
    gateway = ChildProcess("gateway", radixpool_argv(
        "gateway", "--worker-urls", fuzz_worker.url, "--port", str(port),
        "--log-level", "warning"), port, log)
    try:
        gateway.start()
        gateway.wait_ready(60)
        yield gateway
    finally:
        gateway.reap()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors(fuzz_worker, mode):
    fuzz_operations(fuzz_worker, fuzz_worker.url, mode)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors_through_the_gateway(fuzz_worker, fuzz_gateway, mode):
    fuzz_operations(fuzz_worker, fuzz_gateway.url, mode, fuzz_gateway)
    metrics = httpx.get(f"{fuzz_gateway.url}/metrics").text
    routed = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("radixpool_gateway_requests_total{"))
    assert routed >= 25, "the fuzzed requests did not go through the gateway"


def fuzz_operations(fuzz_worker, url: str, mode: GenerationMode, gateway=None) -> None:
    """Every operation of the worker's schema, sent to `url` (the worker, or a gateway in
    front of it)."""
    schema = schemathesis.openapi.from_url(f"{fuzz_worker.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    failures = []
    for op in operations:
        if mode is GenerationMode.POSITIVE and op.path in SKIP_POSITIVE:
            continue

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def fuzz(case):
            case.call_and_validate(base_url=url, checks=[not_a_server_error], timeout=60)

        try:
            fuzz()
        except Unsatisfiable:   # no input can be invalid (an operation without parameters)
            assert mode is GenerationMode.NEGATIVE
        except Exception as exc:
            failures.append(f"{op.label}: {exc}")
        assert fuzz_worker.proc.poll() is None, fuzz_worker.log()[-3000:]
        if gateway is not None:
            assert gateway.proc.poll() is None, gateway.log_path.read_text()[-3000:]
    assert not failures, "\n\n".join(failures)


def test_still_serving_after_fuzzing(fuzz_worker):
    r = httpx.post(f"{fuzz_worker.url}/v1/completions",
                   json={"prompt": "still there?", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    assert httpx.get(f"{fuzz_worker.url}/health").status_code == 200
