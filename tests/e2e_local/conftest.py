"""One local fleet for the whole folder: 3 real `radixpool worker` processes (tiny model, CPU,
`--debug-invariants`: the engine checks its KV bookkeeping every time it goes idle, and a
violation kills the engine, which `/health` then reports) behind a real `radixpool gateway`
process, started by `radixpool.fleet.LocalFleet` exactly as `radixpool up` does.

Tests that break the fleet (kill, restart, flush) leave it whole again. Every process is stopped
by its PID when the folder is done, whether the tests passed or not.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="real workers need the `worker` extra (torch)")

from radixpool.fleet.fleet import FleetSpec, LocalFleet

from .fleet_probes import MODEL

WORKERS = 3


@pytest.fixture(scope="package")
def fleet(tiny_model, tmp_path_factory):
    spec = FleetSpec(model=tiny_model, workers=WORKERS, port=0, served_model_name=MODEL,
                     kv_cache_tokens=4096, worker_args=("--debug-invariants",),
                     log_dir=tmp_path_factory.mktemp("fleet-logs"))
    local = LocalFleet(spec)
    try:
        local.start()
        yield local
    finally:
        local.stop()


@pytest.fixture
def sdk(fleet):
    from openai import OpenAI

    return OpenAI(base_url=fleet.base_url, api_key="unused", max_retries=0, timeout=120)
