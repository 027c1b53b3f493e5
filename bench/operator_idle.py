"""API-server requests an idle operator costs: requests per pool per minute, from the API server.

    python bench/operator_idle.py --kubeconfig ADMIN_KUBECONFIG [--pools 10] [--seconds 120]
        [--warmup 45] [--resync 15] [--operator-path DIR]

Makes `--pools` pools in a fresh namespace (CPU, a model path that never loads: nothing changes
once they exist), runs `radixpool operator --namespace NS --standalone` on them, and reads the
API server's own counter `apiserver_request_total` (from /metrics) at the start and end of a
window with the operator running, then of a window of the same length with it stopped (what
the controller-manager and this script cost). The difference, per pool per minute, is the
operator's; it is printed by verb. `--operator-path` puts another checkout's `operator/` first
on PYTHONPATH (e.g. an export of the previous version) to compare versions on one cluster.
Needs kubectl and a cluster-admin kubeconfig (for /metrics); ../shared/tools/k8s-local/ starts
one locally.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

SAMPLE = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')
WRITES = {"APPLY", "PATCH", "POST", "PUT", "DELETE", "DELETECOLLECTION"}


def request_counts(kubeconfig: str) -> collections.Counter:
    """apiserver_request_total summed by verb."""
    text = subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "get", "--raw", "/metrics"],
                          check=True, capture_output=True, text=True).stdout
    counts: collections.Counter = collections.Counter()
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
            counts[labels.get("verb", "")] += float(match["value"])
    return counts


def window(kubeconfig: str, seconds: float) -> collections.Counter:
    before = request_counts(kubeconfig)
    time.sleep(seconds)
    after = request_counts(kubeconfig)
    return collections.Counter({verb: after[verb] - before[verb] for verb in after})


def pool(name: str) -> dict:
    return {"apiVersion": "radixpool.io/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": name},
            "spec": {"replicas": 1, "model": {"path": "/models/absent"},
                     "engine": {"device": "cpu", "resources": {"gpus": 0, "cpu": "100m",
                                                               "memory": "512Mi"}},
                     "gateway": {"resources": {"cpu": "50m", "memory": "128Mi"}}}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--pools", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--warmup", type=float, default=45)
    parser.add_argument("--resync", type=float, default=15)
    parser.add_argument("--operator-path", help="checkout whose operator/ to run")
    args = parser.parse_args()

    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=args.kubeconfig)
    core, custom = client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
    namespace = f"bench-idle-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": namespace}})
    env = dict(os.environ)
    if args.operator_path:
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(args.operator_path, "operator"),
                                             env.get("PYTHONPATH", "")])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    operator = None
    try:
        for index in range(args.pools):
            custom.create_namespaced_custom_object("radixpool.io", "v1alpha1", namespace,
                                                   "inferencepools", pool(f"idle-{index}"))
        operator = subprocess.Popen(
            [sys.executable, "-m", "radixpool.cli", "operator", "--namespace", namespace,
             "--standalone", "--kubeconfig", args.kubeconfig,
             f"--resync-seconds={args.resync}", f"--liveness=http://127.0.0.1:{port}/healthz"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(args.warmup)
        running = window(args.kubeconfig, args.seconds)
        operator.send_signal(signal.SIGTERM)
        operator.wait(timeout=60)
        time.sleep(5)
        stopped = window(args.kubeconfig, args.seconds)
    finally:
        if operator is not None and operator.poll() is None:
            operator.kill()
        for index in range(args.pools):  # versions before 0.2 left a finalizer on each pool
            custom.patch_namespaced_custom_object(
                "radixpool.io", "v1alpha1", namespace, "inferencepools", f"idle-{index}",
                {"metadata": {"finalizers": None}})
        core.delete_namespace(namespace)

    minutes = args.seconds / 60
    per_pool = {verb: (running[verb] - stopped[verb]) / args.pools / minutes
                for verb in sorted(set(running) | set(stopped))}
    total = sum(per_pool.values())
    writes = sum(value for verb, value in per_pool.items() if verb in WRITES)
    print(f"pools={args.pools} window={args.seconds:.0f}s resync={args.resync:.0f}s "
          f"operator={args.operator_path or 'this checkout'}")
    print("requests per pool per minute, by verb: " + ", ".join(
        f"{verb} {value:.1f}" for verb, value in per_pool.items() if abs(value) >= 0.05))
    print(f"total {total:.1f} requests/pool/min, of which writes {writes:.1f}; "
          f"whole fleet {total * args.pools / 60:.2f} requests/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
