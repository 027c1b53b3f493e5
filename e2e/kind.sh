#!/usr/bin/env bash
# Makes a kind cluster, builds and loads the RadixPool images, and runs the live e2e suite.
# Needs docker, kind and kubectl. Usage: e2e/kind.sh [--keep] [--no-build]
#   --keep      leave the cluster running afterwards (delete: kind delete cluster --name radixpool-e2e)
#   --no-build  reuse images already loaded
# The worker image is large (CUDA + torch); the e2e does not need a GPU: pods run with gpus: 0.
set -euo pipefail
cd "$(dirname "$0")/.."
cluster="${RADIXPOOL_KIND_CLUSTER:-radixpool-e2e}"
tag="e2e-$(git rev-parse --short HEAD 2>/dev/null || echo local)"
keep=0 build=1
for arg in "$@"; do
  case "$arg" in
    --keep) keep=1 ;;
    --no-build) build=0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null || { echo "e2e/kind.sh needs $tool on PATH" >&2; exit 1; }
done

if ! kind get clusters 2>/dev/null | grep -qx "$cluster"; then
  kind create cluster --name "$cluster" --wait 120s
fi
kubeconfig="$(mktemp)"
kind get kubeconfig --name "$cluster" > "$kubeconfig"
[ "$keep" = 1 ] || trap 'kind delete cluster --name "$cluster"; rm -f "$kubeconfig"' EXIT

if [ "$build" = 1 ]; then
  docker build -f Dockerfile.control -t "radixpool-control:$tag" .
  docker build -f Dockerfile.worker -t "radixpool-worker:$tag" .
fi
kind load docker-image --name "$cluster" "radixpool-control:$tag" "radixpool-worker:$tag"

. scripts/setup
RADIXPOOL_E2E_KUBECONFIG="$kubeconfig" \
RADIXPOOL_E2E_WORKER_IMAGE="radixpool-worker:$tag" \
RADIXPOOL_E2E_GATEWAY_IMAGE="radixpool-control:$tag" \
  python -m pytest -v -rs e2e/test_operator_live.py

# The chart, installed for real once the suite (which runs its own operator) is done.
if command -v helm >/dev/null; then
  helm upgrade --install radixpool charts/radixpool --kubeconfig "$kubeconfig" \
    --namespace radixpool-system --create-namespace --wait --timeout 5m \
    --set image.repository=radixpool-control --set image.tag="$tag" \
    --set workerImage.repository=radixpool-worker --set workerImage.tag="$tag" \
    --set gatewayImage.repository=radixpool-control --set gatewayImage.tag="$tag"
  kubectl --kubeconfig "$kubeconfig" -n radixpool-system rollout status deploy/radixpool --timeout=120s
  kubectl --kubeconfig "$kubeconfig" get llmpool -A
else
  echo "helm not on PATH: skipped installing the chart into the kind cluster"
fi
