#!/usr/bin/env bash
# One call on a lent GPU machine, in stages, each with its own time limit and log, so a slow or
# failing stage leaves the others' results:
#   tests   the CUDA-only tests
#   warmup  bench/warmup.py: start-up and first-request latency with and without the engine's
#           warm-up, each with an empty FlashInfer JIT cache
#   soak    bench/gpu_soak.py for $SOAK_SECONDS (default 60), the invariant checker on
#   small   bench/gpu.py's Qwen3-0.6B rows (host vs device per decode step, overlap on and off)
#   server  bench/gpu_server.py: `radixpool worker` itself (HTTP process and engine core) on the
#           GPU, called with the openai SDK, then its core stopped for the watchdog
#   bench   the whole quick table (Llama-3.1-8B rows too), if over 150 s are left
#
#   bash bench/gpu_check.sh [SECONDS]     # SECONDS: the whole run's budget (default 570)
#   STAGES="warmup soak small" SOAK_SECONDS=150 bash bench/gpu_check.sh 560
#
# (default STAGES: "tests soak bench"). The stages share one FlashInfer JIT cache
# (/tmp/gpu-check-jit), so each kernel is built once; warmup compares against a second, empty one.
#
# Wheels the machine lacks are read from .whl/ when present (the machine is offline); fetch them
# here first, for its Python 3.12, and carry .whl with the call:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2 uvicorn==0.54.0 httptools==0.9.0 \
#     xgrammar==0.2.8 jsonschema==4.26.0 jsonschema-specifications referencing rpds-py attrs \
#     pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection typing_extensions==4.16.0 \
#     fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 annotated-doc==0.0.7 \
#     openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 \
#     sniffio==1.3.1 anyio==4.16.0 h11==0.16.0 idna==3.20 jsonpointer==3.12
# (uvicorn and httptools: one test parses the worker's command line, which imports the HTTP edge;
# xgrammar, jsonschema and pydantic: the soak's constrained requests; fastapi to jsonpointer: the
# server stage's worker and its openai client, found by importing with PYTHONPROFILEIMPORTTIME=1. apache-tvm-ffi must be the
# release pip resolves for the image, where xgrammar asks for >= 0.1.11: with 0.1.4 xgrammar
# failed and the core ended every constrained request.) Add --platform manylinux2014_x86_64 for
# pydantic-core and rpds-py.
# Logs go to $OUT (or ./gpu-check-out), a summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=${1:-570}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# torch builds older than tvm-ffi expects lack the DLPack exchange hook; without this tvm-ffi
# compiles a torch add-on at import.
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
# one kernel cache for every stage (bench/warmup.py builds its first variant's kernels here)
export FLASHINFER_WORKSPACE_BASE=/tmp/gpu-check-jit
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/common:$PWD/worker:$PWD/gateway:$PWD/operator:$PWD:$PWD/tests/worker

summary=()
left() { echo $((BUDGET - SECONDS)); }
stage() {  # stage NAME LIMIT COMMAND...: run with a time limit, keep its log and exit status
  local name=$1 limit=$2; shift 2
  local cap; cap=$(left)
  if (( cap < 30 )); then summary+=("$name: not run (budget spent)"); return; fi
  (( limit > cap )) && limit=$cap
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name: exit $rc in $((SECONDS - t0)) s (limit $limit s); last line: $(tail -n 1 "$OUT/$name.log")")
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' 2>&1 | tail -n 1
  python3 -c 'import transformers; print("transformers", transformers.__version__)'
} >"$OUT/machine.log" 2>&1
cat "$OUT/machine.log"

STAGES=${STAGES:-tests soak bench}
SOAK_SECONDS=${SOAK_SECONDS:-60}
for name in $STAGES; do
  case $name in
    tests)
      stage tests 330 python3 -m pytest -p no:cacheprovider -q -rs \
        --junitxml="$OUT/tests.xml" \
        tests/worker/test_gpu_step_sync.py tests/worker/test_sampler_device.py \
        tests/worker/test_attention_conformance.py tests/worker/test_gpu_equivalence.py \
        tests/worker/test_decode_graphs.py tests/worker/test_gpu_memory.py
      grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 3 ;;
    warmup)
      stage warmup 300 python3 bench/warmup.py --jit-base /tmp/gpu-check-jit
      cat "$OUT/warmup.log" ;;
    soak)
      stage soak $((SOAK_SECONDS + 140)) python3 bench/gpu_soak.py --seconds "$SOAK_SECONDS"
      tail -n 12 "$OUT/soak.log" ;;
    small)
      stage small 200 python3 bench/gpu.py --preset gpu-quick --skip-llama \
        --out "$OUT/gpu_small.txt"
      tail -n 8 "$OUT/small.log" ;;
    server)
      stage server 330 python3 bench/gpu_server.py --log "$OUT/worker.log"
      grep -E "^(PASS|FAIL)|failed$" "$OUT/server.log" ;;
    bench)
      if (( $(left) > 150 )); then
        stage bench 400 python3 bench/gpu.py --preset gpu-quick --out "$OUT/gpu_table.txt"
      fi ;;
    *) summary+=("$name: unknown stage") ;;
  esac
done

echo "== summary (${SECONDS} s of ${BUDGET} s)"
printf '%s\n' "${summary[@]}"
