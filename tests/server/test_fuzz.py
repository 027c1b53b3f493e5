"""Schemathesis fuzzes every operation of the worker's OpenAPI schema, with valid and invalid
data: never a 5xx, and the server keeps serving. The `fuzz_worker` has a 32-token context, so
fuzzed generations stay short on a CPU."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

pytestmark = pytest.mark.slow

EXAMPLES = 25
# Valid long polls only make the run slow (invalid ones are fuzzed in the negative mode).
SKIP_POSITIVE = {"/kv_events"}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors(fuzz_worker, mode):
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
            case.call_and_validate(checks=[not_a_server_error], timeout=60)

        try:
            fuzz()
        except Unsatisfiable:   # no input can be invalid (an operation without parameters)
            assert mode is GenerationMode.NEGATIVE
        except Exception as exc:
            failures.append(f"{op.label}: {exc}")
        assert fuzz_worker.proc.poll() is None, fuzz_worker.log()[-3000:]
    assert not failures, "\n\n".join(failures)


def test_still_serving_after_fuzzing(fuzz_worker):
    r = httpx.post(f"{fuzz_worker.url}/v1/completions",
                   json={"prompt": "still there?", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    assert httpx.get(f"{fuzz_worker.url}/health").status_code == 200
