"""`radixpool up` as a user runs it (a process, Ctrl-C to stop), and the demo's workload played
through the shared fleet."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from radixpool.fleet.demo import QUICK_SHAPE, run_jobs
from radixpool.fleet.report import summarize
from radixpool.fleet.workload import demo_jobs

from .fleet_probes import MODEL

pytestmark = pytest.mark.slow


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
            kids = [int(c) for t in tasks for c in (t / "children").read_text().split()]
        except OSError:
            continue
        found.update(kids)
        todo.extend(kids)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_up_serves_the_openai_api_and_ctrl_c_leaves_nothing_behind(tiny_model, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "up.out"
    with open(out, "wb") as sink:
        up = subprocess.Popen(
            [sys.executable, "-m", "radixpool.cli", "up", "--model", str(tiny_model),
             "--served-model-name", "tiny-up", "--workers", "1", "--port", "0",
             "--device", "cpu"], stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while "OpenAI base URL" not in out.read_text():
            assert up.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        text = out.read_text()
        assert "loading:" in text  # readiness progress while the model loads
        base_url = re.search(r"OpenAI base URL:\s+(\S+)", text).group(1)
        started = _descendants(up.pid)
        assert len(started) >= 3  # the gateway, the worker and its engine core

        sdk = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
        answer = sdk.chat.completions.create(
            model="tiny-up", messages=[{"role": "user", "content": "hello"}], max_tokens=3)
        assert answer.usage.completion_tokens > 0

        up.send_signal(signal.SIGINT)
        assert up.wait(120) == 0, out.read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert "stopped: every process this fleet started has exited" in out.read_text()
    assert [pid for pid in started if _alive(pid)] == []


def test_the_demo_workload_hits_the_cache_through_the_gateway(fleet):
    results = run_jobs(fleet.gateway.url, MODEL, demo_jobs(QUICK_SHAPE), clients=4)
    summary = summarize("cache_aware", results, 1.0, None, fleet.worker_urls)
    assert summary.failed == 0 and summary.requests == QUICK_SHAPE.requests
    assert summary.hit_rate > 0.3
    assert abs(sum(summary.worker_share.values()) - 1) < 1e-9
