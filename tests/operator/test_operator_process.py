"""The operator as a process: no torch, a CLI that explains itself, a clear failure off-cluster."""

from __future__ import annotations

import os
import subprocess
import sys


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60,
                          env=env)


def test_operator_never_imports_torch():
    code = ("import sys; import radixpool.operator.handlers, radixpool.operator.cli, "
            "radixpool.operator.kube; assert 'torch' not in sys.modules, 'torch imported'; "
            "print('ok')")
    result = run("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_cli_offers_the_documented_flags():
    result = run("-m", "radixpool.cli", "operator", "--help")
    assert result.returncode == 0, result.stderr
    for flag in ("--namespace", "--all-namespaces", "--liveness", "--peering", "--standalone"):
        assert flag in result.stdout
    both = run("-m", "radixpool.cli", "operator", "--namespace", "a", "--all-namespaces")
    assert both.returncode == 2 and "not allowed with" in both.stderr


def test_without_a_cluster_it_exits_fast_with_a_reason(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("KUBECONFIG", None)
    env.pop("KUBERNETES_SERVICE_HOST", None)
    result = run("-m", "radixpool.cli", "operator", env=env)
    assert result.returncode == 1
    assert "no Kubernetes credentials" in result.stderr


def test_a_prometheus_peer_that_is_no_peer_stops_it_at_once_with_a_reason(tmp_path):
    """Not a traceback, nor a peer in every pool's NetworkPolicy that the API server refuses."""
    env = {**os.environ, "HOME": str(tmp_path), "RADIXPOOL_PROMETHEUS_PEER": "[\"monitoring\"]"}
    result = run("-m", "radixpool.cli", "operator", env=env)
    assert result.returncode == 2
    assert "RADIXPOOL_PROMETHEUS_PEER must be a NetworkPolicy peer" in result.stderr
