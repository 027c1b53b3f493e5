"""`radixpool operator` as a real process (kopf, its watches, its patches) against the fake API
server: a pool appears → objects and status; spec edits and drift are acted on; no finalizer is
put on pools (one an older version left is lifted); SIGTERM stops it cleanly. The live-cluster
version of this is e2e/test_operator_live.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from fake_apiserver import FakeAPIServer

POOL = "apis/radixpool.io/v1alpha1/namespaces/ml/inferencepools/llama"
WORKER = "apis/apps/v1/namespaces/ml/deployments/llama-worker"
WORKER_SERVICE = "api/v1/namespaces/ml/services/llama-workers"


def wait_for(what: str, check: Callable[[], Any], process: subprocess.Popen,
             timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        if process.poll() is not None:
            pytest.fail(f"operator exited with {process.returncode} while waiting for {what}")
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def stop(process: subprocess.Popen, log) -> int:
    """SIGTERM, as the kubelet sends; the operator's exit code (killed after 20 s: an error)."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    finally:
        log.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def condition(store, kind: str) -> dict:
    for cond in store.objects.get(POOL, {}).get("status", {}).get("conditions", []):
        if cond["type"] == kind:
            return cond
    return {}


@pytest.mark.slow
def test_operator_process_reconciles_heals_and_stops(tmp_path, pool_body):
    with FakeAPIServer() as fake:
        store = fake.store
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(fake.kubeconfig())
        store.put("api/v1/namespaces/ml", {"apiVersion": "v1", "kind": "Namespace",
                                          "metadata": {"name": "ml"}})
        old = pool_body(replicas=2)
        old["metadata"]["finalizers"] = ["radixpool.io/finalizer"]  # as older versions left it
        store.put(POOL, old)
        port = free_port()
        log = (tmp_path / "operator.log").open("w")
        process = subprocess.Popen(
            [sys.executable, "-m", "radixpool.cli", "operator", "--namespace", "ml",
             "--standalone", "--kubeconfig", str(kubeconfig), "--resync-seconds", "1",
             "--liveness", f"http://127.0.0.1:{port}/healthz"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(tmp_path)})
        try:
            wait_for("the worker Deployment", lambda: WORKER in store.objects, process)
            accepted = wait_for("Accepted=True", lambda: condition(store, "Accepted").get(
                "status") == "True", process)
            assert accepted
            pool = store.objects[POOL]
            assert pool["status"]["selector"] == (
                "app.kubernetes.io/component=worker,radixpool.io/pool=llama")
            wait_for("the old finalizer lifted", lambda: not store.objects[POOL]["metadata"].get(
                "finalizers"), process)
            assert store.objects[WORKER]["spec"]["replicas"] == 2
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as reply:
                assert reply.status == 200

            scaled = pool_body(replicas=3)
            scaled["metadata"] = {**store.objects[POOL]["metadata"]}
            store.put(POOL, {**scaled, "status": store.objects[POOL]["status"]})
            wait_for("scale to 3", lambda: store.objects[WORKER]["spec"]["replicas"] == 3,
                     process)

            store.delete(WORKER_SERVICE)
            wait_for("the deleted Service put back", lambda: WORKER_SERVICE in store.objects,
                     process)
            store.objects[WORKER]["status"] = {"replicas": 3, "readyReplicas": 3,
                                               "updatedReplicas": 3, "observedGeneration": 99}
            wait_for("WorkersReady from observation", lambda: condition(
                store, "WorkersReady").get("status") == "True", process)

            store.delete(POOL)
            assert POOL not in store.objects  # no finalizer: deleting needs no operator
        finally:
            code = stop(process, log)
        output = (tmp_path / "operator.log").read_text()
        assert code == 0, output[-3000:]
        # the timer ran (it put the Service back and read the workers ready), and its
        # successes, one per pool per resync, no longer fill the log
        assert "Timer 'check_pool' succeeded" not in output, output[-3000:]
        assert "succeeded." in output   # the other handlers' lines stay


@pytest.mark.slow
def test_two_replicas_never_fight(tmp_path, pool_body):
    """With peering, the replica with the higher priority works and the other one waits."""
    with FakeAPIServer() as fake:
        store = fake.store
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(fake.kubeconfig())
        store.put("api/v1/namespaces/ml", {"apiVersion": "v1", "kind": "Namespace",
                                          "metadata": {"name": "ml"}})
        store.put("apis/kopf.dev/v1/namespaces/ml/kopfpeerings/radixpool", {
            "apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
            "metadata": {"name": "radixpool", "namespace": "ml"}})
        logs, processes = [], []
        for priority in (10, 20):
            logs.append(tmp_path / f"operator-{priority}.log")
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "radixpool.cli", "operator", "--namespace", "ml",
                 "--priority", str(priority), "--kubeconfig", str(kubeconfig),
                 "--liveness", f"http://127.0.0.1:{free_port()}/healthz"],
                stdout=logs[-1].open("w"), stderr=subprocess.STDOUT,
                env={**os.environ, "TMPDIR": str(tmp_path)}))
        try:
            wait_for("both replicas in the peering object", lambda: len(
                store.objects["apis/kopf.dev/v1/namespaces/ml/kopfpeerings/radixpool"].get(
                    "status") or {}) == 2, processes[0], timeout=90)  # two cold starts: slow
            store.put(POOL, pool_body())
            wait_for("the worker Deployment", lambda: WORKER in store.objects, processes[1])
            time.sleep(1)
        finally:
            for process in processes:
                process.send_signal(signal.SIGTERM)
            for process in processes:
                process.wait(timeout=20)
        handled = ["Handler 'apply_pool' succeeded" in log.read_text() for log in logs]
        assert handled == [False, True]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


@pytest.mark.slow
def test_liveness_on_all_addresses_answers_ipv6_and_ipv4(tmp_path):
    """The default `--liveness http://[::]:8081/healthz` (the chart's too) answers kubelet on an
    IPv6-only pod IP and on a dual-stack pod's IPv4 one. kopf's own endpoint bound `::`
    IPv6-only, and the old default `0.0.0.0` IPv4-only."""
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback on this machine: {exc}")
    with FakeAPIServer() as fake:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(fake.kubeconfig())
        port = free_port()
        log = (tmp_path / "operator.log").open("w")
        process = subprocess.Popen(
            [sys.executable, "-m", "radixpool.cli", "operator", "--namespace", "ml",
             "--standalone", "--kubeconfig", str(kubeconfig),
             "--liveness", f"http://[::]:{port}/healthz"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(tmp_path)})
        try:
            wait_for("liveness on [::1]", lambda: _answers(f"http://[::1]:{port}/healthz"),
                     process, timeout=60)
            assert _answers(f"http://127.0.0.1:{port}/healthz")
        finally:
            code = stop(process, log)
        assert code == 0, (tmp_path / "operator.log").read_text()[-3000:]


def test_a_liveness_url_without_a_port_is_refused_naming_it(capsys):
    from radixpool.cli import main

    assert main(["operator", "--standalone", "--liveness", "http://[::]/healthz"]) == 2
    assert "--liveness 'http://[::]/healthz'" in capsys.readouterr().err
