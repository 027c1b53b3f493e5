"""What the engine's warm-up buys the first requests: start-up time and first-token latency of
the first two requests, with the warm-up and without it, each in a fresh process.

    python bench/warmup.py                  # on a GPU: Qwen3-0.6B configuration, random weights
    python bench/warmup.py --device cpu     # the same on CPU, with the model scaled down

Each variant runs in its own process with its own empty FlashInfer JIT cache
(`FLASHINFER_WORKSPACE_BASE`), as a new pod from an image without prebuilt kernels would:
kernels missing from the cache are compiled on first use. The start (weights, KV pool, CUDA
graph capture: the decode kernels are built there) is timed, then the warm-up when it is on,
then the first request (a fresh 1,000-token prefill) and a second one over the first's cached
prompt plus 200 tokens (a prefill over a cached prefix), each from the moment it is added to its
first token. The attention backend is the engine's own choice (`auto`) unless `--backend` says.
`--jit-base DIR` puts the first variant's cache (warm-up on) in DIR, so that later runs
sharing DIR reuse its kernels; DIR should be empty for the comparison to be fair, and the table
says whether it was. `--keep-jit-cache` uses the machine's own cache for both (kernels built
earlier are reused). Each variant's row is printed as soon as it has run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file

from bench.gpu import TINY  # the scaled-down shape of the other GPU benches


def first_token_seconds(core, rid: str, prompt: list[int]) -> float:
    from radixpool.worker.messages import GenerateRequest
    from radixpool.worker.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    refused = core.add_request(GenerateRequest(rid, prompt, params, seed=0))
    if refused is not None:
        raise RuntimeError(f"request {rid} refused: {refused.error}")
    first = None
    while core.has_work:
        for delta in core.step().deltas:
            if delta.rid == rid and delta.token_ids and first is None:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"request {rid} produced no token")
    return first


def child(args) -> dict:
    """One variant, in this process: start, warm up (or not), two requests."""
    import torch

    from radixpool.worker.config import EngineConfig
    from radixpool.worker.engine_core import EngineCore
    from radixpool.worker.model.reference_configs import write_reference_config

    cpu = args.device == "cpu"
    model = write_reference_config(tempfile.mkdtemp(prefix="warmup-"), args.model,
                                   **(TINY if cpu else {}))
    t0 = time.perf_counter()
    core = EngineCore(EngineConfig(
        str(model), device=args.device, random_weights=True, page_size=args.page_size,
        attention_backend=args.backend or "auto", kv_cache_tokens=16384 if cpu else None,
        context_length=4096, max_running_requests=64))
    if args.device == "cuda":
        torch.cuda.synchronize()
    start_s = time.perf_counter() - t0
    warmup_s, steps = 0.0, 0
    if args.child == "on":
        t0 = time.perf_counter()
        steps = core.warm_up()
        warmup_s = time.perf_counter() - t0
    vocab = core.runner.vocab_size
    prompt = [(13 * i + 101) % vocab for i in range(1000)]
    ttft1 = first_token_seconds(core, "first", prompt)
    ttft2 = first_token_seconds(core, "second", prompt + [(17 * i + 5) % vocab
                                                         for i in range(200)])
    return dict(warmup=args.child, backend=core.runner.attention_backend_name,
                graphs=core.runner.decode_graphs is not None, start_s=start_s,
                warmup_s=warmup_s, warmup_steps=steps, ttft1_s=ttft1, ttft2_s=ttft2)


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="qwen3-0.6b", help="reference configuration")
    p.add_argument("--backend", help="attention backend (default: the engine's auto)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--keep-jit-cache", action="store_true",
                   help="use the machine's FlashInfer JIT cache, not a fresh one per variant")
    p.add_argument("--jit-base", help="FlashInfer cache base of the warm-up-on variant "
                                      "(default: a new temporary one)")
    p.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    for variant in ("on", "off"):
        env = dict(os.environ)
        jit = "machine's"
        if not args.keep_jit_cache:
            base = (args.jit_base if variant == "on" and args.jit_base
                    else tempfile.mkdtemp(prefix=f"fi-jit-{variant}-"))
            os.makedirs(base, exist_ok=True)
            built = [f for _, _, files in os.walk(base) for f in files if f.endswith(".so")]
            jit = "empty" if not built else f"{len(built)} built"
            env["FLASHINFER_WORKSPACE_BASE"] = base
        cmd = [sys.executable, __file__, "--child", variant, "--device", args.device,
               "--model", args.model, "--page-size", str(args.page_size)]
        if args.backend:
            cmd += ["--backend", args.backend]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            print(f"warm-up {variant}: exit {done.returncode}\n{done.stderr[-3000:]}")
            return 1
        r = json.loads(done.stdout.strip().splitlines()[-1])
        if variant == "on":
            print(f"# {name}; {args.model}{' (scaled down)' if args.device == 'cpu' else ''}, "
                  f"random weights, page size {args.page_size}, attention {r['backend']}, "
                  f"decode graphs {'on' if r['graphs'] else 'off'}")
            print("  warm-up  JIT cache  start s  warm-up s (steps)  ready s  1st TTFT s  "
                  "2nd TTFT s (cached prefix)")
        print(f"  {r['warmup']:<7}  {jit:<9} {r['start_s']:8.2f} {r['warmup_s']:10.2f} "
              f"({r['warmup_steps']:>2}) {r['start_s'] + r['warmup_s']:9.2f} "
              f"{r['ttft1_s']:11.3f} {r['ttft2_s']:11.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
