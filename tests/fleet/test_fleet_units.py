"""The local fleet's pure parts, without processes: the spec's checks, the demo's workload, its
numbers and table, the progress text. Importing radixpool.fleet never imports torch."""

from __future__ import annotations

import io
import math
import socket
import subprocess
import sys

import pytest

from radixpool.fleet.client import ChatResult
from radixpool.fleet.fleet import FleetSpec, LocalFleet, Readiness
from radixpool.fleet.process import PortInUse, port_is_free
from radixpool.fleet.progress import StatusLine, bar, readiness_text
from radixpool.fleet.report import format_table, percentile, summarize, verdict
from radixpool.fleet.workload import MULTI_TURN, SHARED_PREFIX, WorkloadShape, demo_jobs


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_spec_rejects_what_cannot_run_and_says_why(model_dir, tmp_path):
    with pytest.raises(ValueError, match="workers: must be at least 1"):
        FleetSpec(model=model_dir, workers=0)
    with pytest.raises(ValueError, match="worker-port-base"):
        FleetSpec(model=model_dir, workers=3, worker_port_base=65534)
    with pytest.raises(ValueError, match="not a model directory"):
        FleetSpec(model=tmp_path / "nowhere")
    assert FleetSpec(model=model_dir).model_name == model_dir.name
    assert FleetSpec(model=model_dir, served_model_name="tiny").model_name == "tiny"


def test_workload_is_deterministic_and_mixes_both_kinds():
    shape = WorkloadShape(groups=3, questions=4, conversations=2, turns=3)
    jobs = demo_jobs(shape)
    assert jobs == demo_jobs(shape)
    assert sum(len(j.turns) for j in jobs) == shape.requests == 3 * 4 + 2 * 3
    kinds = [j.kind for j in jobs]
    assert kinds.count(MULTI_TURN) == 2 and kinds.count(SHARED_PREFIX) == 12
    assert kinds[-1] == SHARED_PREFIX  # conversations start during the run, not after it
    assert len({j.system for j in jobs if j.kind == SHARED_PREFIX}) == 3


def _ok(worker: str, prompt: int, cached: int, ttft: float) -> ChatResult:
    return ChatResult(True, ttft * 2, ttft, prompt, cached, 4, "text", worker)


def test_summary_counts_ground_truth_per_workload_and_worker():
    results = [(SHARED_PREFIX, _ok("a", 100, 90, 0.1)), (SHARED_PREFIX, _ok("a", 100, 0, 0.3)),
               (MULTI_TURN, _ok("b", 200, 100, 0.2)),
               (MULTI_TURN, ChatResult(False, 1.0, error="HTTP 503: busy"))]
    s = summarize("cache_aware", results, 2.0, 0.4, ["a", "b", "c"])
    assert (s.requests, s.failed, s.first_error) == (4, 1, "HTTP 503: busy")
    assert s.throughput == 1.5
    assert s.hit_rate == 190 / 400 and s.computed_tokens == 210
    assert s.hit_rate_by_kind == {MULTI_TURN: 0.5, SHARED_PREFIX: 0.45}
    assert s.worker_share == {"a": 2 / 3, "b": 1 / 3, "c": 0.0}
    assert (s.ttft_p50_s, s.ttft_p99_s) == (0.2, 0.3)


def test_table_puts_policies_side_by_side():
    aware = summarize("cache_aware", [(SHARED_PREFIX, _ok("a", 100, 90, 0.05))], 1.0, 0.85,
                      ["a", "b"])
    rr = summarize("round_robin", [(SHARED_PREFIX, _ok("b", 100, 10, 0.2))], 2.0, None,
                   ["a", "b"])
    table = format_table([aware, rr])
    header, *rows = table.splitlines()
    assert header.split() == ["cache_aware", "round_robin"]
    line = {r[:28].strip(): r[28:].split("  ") for r in rows}
    cells = {label: [c.strip() for c in row if c.strip()] for label, row in line.items()}
    assert cells["cache hit rate (workers)"] == ["90.0 %", "10.0 %"]
    assert cells["predicted hit rate (gateway)"] == ["85.0 %", "n/a"]
    assert cells["worker share"] == ["100 / 0 %", "0 / 100 %"]
    assert "2.0x the throughput" in verdict(aware, rr)
    assert "89 % fewer prompt tokens computed" in verdict(aware, rr)


def test_percentile_is_nearest_rank():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(1, 101)), 99) == 99
    assert math.isnan(percentile([], 50))


def test_progress_text_and_a_log_friendly_status_line():
    assert readiness_text(Readiness(1, 3, False, 12.4, ["worker 1", "worker 2"])) == \
        "loading: 1/3 workers ready (12 s; waiting for worker 1, worker 2)"
    assert readiness_text(Readiness(3, 3, True, 20.0)).startswith("ready: 3 workers")
    assert readiness_text(Readiness(1, 1, True, 9.0)) == "ready: 1 worker and the gateway in 9 s"
    assert bar("x", 5, 10) == "x [###############...............] 5/10"
    out = io.StringIO()
    status = StatusLine(out)
    for i in range(50):
        status.show(f"step {i}")
    status.show("done", final=True)
    assert out.getvalue().splitlines() == ["step 0", "done"]  # throttled, no \r in a log


def test_importing_the_fleet_does_not_import_torch():
    code = ("import sys, radixpool.fleet.demo, radixpool.fleet.up, radixpool.fleet.cli; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_taken_port_is_refused_before_anything_starts(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert not port_is_free("127.0.0.1", port)
        fleet = LocalFleet(FleetSpec(model=model_dir, workers=1, port=port))
        with pytest.raises(PortInUse, match=f"port {port} \\(gateway\\) already in use"):
            fleet.start()
    assert fleet.workers[0].proc is None and fleet.gateway.proc is None
    assert not fleet.log_dir.exists()
