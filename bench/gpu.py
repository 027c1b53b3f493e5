"""GPU performance table: decode and prefill against the device's own roofline, offline serving,
radix-cache speed-up, host vs device time per step.

    python bench/gpu.py                    # on a GPU: Llama-3.1-8B and Qwen3-0.6B, real sizes
    python bench/gpu.py --preset gpu-quick # real sizes, fewer requests: fits a short GPU lease
    python bench/gpu.py --preset cpu       # the same table on CPU with scaled-down models
    python bench/gpu.py --profile          # also a profiler summary of one decode step

Models are the published configurations (`model/reference_configs.py`) with random weights
(nothing is downloaded), random token-id prompts, `ignore_eos`. In the same run the script
measures the device's memory bandwidth (a device-to-device copy: read + write bytes per second)
and its matmul rate in the model dtype, and states every decode figure as a fraction of the
roofline on that very device:

- decode step roofline = (weight bytes + KV bytes read by the batch) / bandwidth;
- prefill roofline = matmul rate / FLOPs per token (2 × parameters in the layers and LM head,
  plus causal attention: 2 × 2 × layers × q_size × mean context);
- serving: 1,000 requests (input ~1k, output ~256, each ±50 %), output tokens/s;
- radix: many requests over a few long system prompts, cache on vs off (off = each request in
  its own cache namespace, so nothing is shared), speed-up in wall time;
- host vs device: Qwen3-0.6B decode, host bookkeeping (schedule + sample + process, less the
  time blocked reading the sampled tokens off the device) per step
  beside the device's forward time per step (CUDA events; on CPU the forward's wall time), with
  the overlapped loop on and off.

Each figure is the median over its measured steps (or runs), after a warm-up. The engine core
runs in-process (no HTTP, no IPC).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

GIB = 1 << 30
TINY = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=8,
            num_key_value_heads=2, head_dim=32, vocab_size=8192, max_position_embeddings=16384,
            bos_token_id=1, eos_token_id=2)
PRESETS = {
    "gpu": dict(scale="full", copy_mib=2048, matmul_n=8192, context=1024, decode_batches=[64, 256],
                decode_steps=64, prefill_tokens=8192, serve_requests=1000, serve_input=1024,
                serve_output=256, prefix_groups=4, prefix_len=2048, prefix_requests=512,
                prefix_suffix=128, prefix_output=64, small_batches=[1, 256]),
    # The same models, batch sizes and decode steps with a quarter of the serving and
    # shared-prefix requests: the same figures, measured over less work.
    "gpu-quick": dict(scale="full", copy_mib=2048, matmul_n=8192, context=1024,
                      decode_batches=[64, 256], decode_steps=64, prefill_tokens=8192,
                      serve_requests=256, serve_input=1024, serve_output=256, prefix_groups=4,
                      prefix_len=2048, prefix_requests=128, prefix_suffix=128, prefix_output=64,
                      small_batches=[1, 256]),
    "cpu": dict(scale="tiny", copy_mib=256, matmul_n=1024, context=256, decode_batches=[8, 32],
                decode_steps=16, prefill_tokens=2048, serve_requests=64, serve_input=128,
                serve_output=32, prefix_groups=2, prefix_len=512, prefix_requests=32,
                prefix_suffix=32, prefix_output=8, small_batches=[1, 32]),
}
TARGETS = {"decode_b1": 0.85, "decode_batch": 0.70, "prefill": 0.60}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device: torch.device, repeats: int = 10) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes per second of a device-to-device copy, counting the read and the write."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), device)
    return 2 * src.numel() / seconds


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / median_time(lambda: a @ b, device)


@dataclass
class ForwardLog:
    """Wraps `runner.forward`: mode, batch size and device time of every forward."""

    device: torch.device
    entries: list = field(default_factory=list)   # [mode, requests, tokens, seconds | events]

    def wrap(self, runner) -> None:
        inner = runner.forward

        def forward(batch):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                out = inner(batch)
                end.record()
                timing = (start, end)
            else:
                t0 = time.perf_counter()
                out = inner(batch)
                timing = time.perf_counter() - t0
            self.entries.append([batch.mode.value, len(batch.prefix_lens), batch.num_tokens,
                                 timing])
            return out
        runner.forward = forward

    def seconds(self, entry) -> float:
        timing = entry[3]
        if isinstance(timing, tuple):
            sync(self.device)
            return timing[0].elapsed_time(timing[1]) / 1e3
        return timing


@dataclass
class Run:
    elapsed: float
    output_tokens: int
    steps: list          # (wall seconds, forward entry or None, bookkeeping seconds)


SAMPLING = {   # the small rows' sampling (--small-sampling)
    "greedy": {"temperature": 0},
    # top-p without top-k: the sampler reads the window's mass back to decide its width
    "top-p": {"temperature": 0.8, "top_p": 0.95},
}


def run_requests(core, log: ForwardLog, prompts: list[list[int]], outputs: list[int],
                 namespaces: list[str | None] | None = None, sampling: str = "greedy") -> Run:
    from radixpool.worker.messages import GenerateRequest
    from radixpool.worker.sampling_params import SamplingParams

    namespaces = namespaces or [None] * len(prompts)
    for i, (ids, out, ns) in enumerate(zip(prompts, outputs, namespaces)):
        params = SamplingParams(max_new_tokens=out, ignore_eos=True, **SAMPLING[sampling])
        core.add_request(GenerateRequest(f"r{i}", ids, params, seed=i, namespace=ns))
    steps, generated = [], 0
    start = time.perf_counter()
    while core.has_work:
        before, t = len(log.entries), core.times
        host_before = t.schedule + t.sample + t.process - t.wait
        t0 = time.perf_counter()
        for delta in core.step().deltas:
            generated += len(delta.token_ids)
        wall = time.perf_counter() - t0
        entry = log.entries[-1] if len(log.entries) > before else None
        steps.append((wall, entry, t.schedule + t.sample + t.process - t.wait - host_before))
    sync(log.device)
    return Run(time.perf_counter() - start, generated, steps)


def random_prompts(rng: random.Random, lengths: list[int], vocab: int) -> list[list[int]]:
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


def make_core(model_dir: str, args, *, overlap: bool | None = None, max_running: int = 256):
    from radixpool.worker.config import EngineConfig
    from radixpool.worker.engine_core import EngineCore

    # On a GPU the pool takes what mem_fraction leaves; on CPU a fixed budget that holds the
    # largest phase (the CPU default would be 4 contexts).
    kv_tokens = None if args.device == "cuda" else args.cpu_kv_tokens
    config = EngineConfig(
        model_dir, device=args.device, random_weights=True, attention_backend=args.backend,
        cuda_graph=not args.disable_cuda_graph, page_size=args.page_size,
        max_running_requests=max_running,
        chunked_prefill_size=args.prefill_tokens, max_prefill_tokens=args.prefill_tokens,
        overlap_schedule=overlap, context_length=args.context_length,
        kv_cache_tokens=kv_tokens)
    core = EngineCore(config)
    log = ForwardLog(core.runner.device)
    log.wrap(core.runner)
    return core, log


def write_model(name: str, args) -> str:
    from radixpool.worker.model.reference_configs import write_reference_config

    overrides = TINY if args.scale == "tiny" else {}
    return str(write_reference_config(tempfile.mkdtemp(prefix=f"bench-{name}-"), name,
                                      **overrides))


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, ...]] = []

    def add(self, metric: str, result: str, reference: str = "", fraction: float | None = None,
            target: str = "") -> None:
        self.rows.append((metric, result, reference,
                          "" if fraction is None else f"{fraction:.0%}", target))
        print(f"  {metric}: {result} {reference}", file=sys.stderr, flush=True)

    def render(self) -> str:
        header = ("metric", "result", "roofline / reference", "of roofline", "target")
        rows = [header, *self.rows]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        return "\n".join(lines)


def decode_phase(core, log, run: Run, batch: int) -> tuple[float, float, float]:
    """Medians over the steps that decoded the full batch: wall, device forward, host."""
    steps = [(w, log.seconds(e), h) for w, e, h in run.steps
             if e is not None and e[0] == "decode" and e[1] == batch]
    if not steps:
        # Prefill admits prefill_tokens / context requests per step while the first ones
        # decode (mixed batches): they finish before the last join unless decode_steps is larger.
        raise SystemExit(f"no decode step ran the whole batch of {batch}: raise --decode-steps "
                         f"above {batch} x context / --prefill-tokens steps")
    steps = steps[2:] or steps   # the first full-batch steps warm up
    return tuple(statistics.median(s[i] for s in steps) for i in range(3))


def bench_llama(args, table: Table, bandwidth: float, flops: float, rng: random.Random) -> None:
    name = "llama-3.1-8b"
    core, log = make_core(write_model(name, args), args, max_running=max(args.decode_batches))
    runner = core.runner
    shape = runner.shape
    kv_per_token = 2 * shape.num_layers * shape.kv_size * shape.itemsize
    vocab = runner.vocab_size
    label = f"{name}{' (tiny)' if args.scale == 'tiny' else ''}"
    table.add(f"{label} weights", f"{shape.weight_bytes / GIB:.2f} GiB",
              f"KV capacity {runner.kv_pool.capacity} tokens")

    for batch in [1, *args.decode_batches]:
        context = args.context if batch > 1 else 128
        run = run_requests(core, log, random_prompts(rng, [context] * batch, vocab),
                           [args.decode_steps] * batch)
        wall, _, _ = decode_phase(core, log, run, batch)
        read = shape.weight_bytes + batch * (context + args.decode_steps // 2) * kv_per_token
        roofline = read / bandwidth
        if batch == 1:
            table.add(f"{label} decode latency, batch 1", f"{wall * 1e3:.2f} ms/token",
                      f"{roofline * 1e3:.2f} ms", roofline / wall, f">= {TARGETS['decode_b1']:.0%}")
        else:
            table.add(f"{label} decode, batch {batch}, {context}-token contexts",
                      f"{batch / wall:,.0f} tokens/s", f"{batch / roofline:,.0f} tokens/s",
                      roofline / wall, f">= {TARGETS['decode_batch']:.0%}")
        core.flush_cache()

    per_request = min(1024, args.prefill_tokens)
    n = args.prefill_tokens // per_request
    # The input embedding is a lookup, not a matmul (tied, it is also the LM head: counted).
    embedding = 0 if runner.spec.tie_word_embeddings else vocab * shape.hidden_size
    params = shape.weight_bytes / shape.itemsize - embedding
    attention = 2 * 2 * shape.num_layers * shape.q_size * per_request / 2
    flops_per_token = 2 * params + attention
    rates = []
    for _ in range(3):
        before = len(log.entries)
        run_requests(core, log, random_prompts(rng, [per_request] * n, vocab), [1] * n)
        rates += [e[2] / log.seconds(e) for e in log.entries[before:] if e[0] == "extend"]
        core.flush_cache()
    rate = statistics.median(rates)
    table.add(f"{label} prefill, {args.prefill_tokens}-token batches", f"{rate:,.0f} tokens/s",
              f"{flops / flops_per_token:,.0f} tokens/s", rate * flops_per_token / flops,
              f">= {TARGETS['prefill']:.0%}")

    inputs = [int(args.serve_input * rng.uniform(0.5, 1.5)) for _ in range(args.serve_requests)]
    outputs = [int(args.serve_output * rng.uniform(0.5, 1.5)) for _ in range(args.serve_requests)]
    run = run_requests(core, log, random_prompts(rng, inputs, vocab), outputs)
    table.add(f"{label} offline serving, {args.serve_requests} requests "
              f"(in ~{args.serve_input}, out ~{args.serve_output}, ±50%)",
              f"{run.output_tokens / run.elapsed:,.0f} output tokens/s",
              "SGLang ~16,000 on H100", None, ">= 16k (H100), > 16k (H200)")
    core.flush_cache()

    systems = random_prompts(rng, [args.prefix_len] * args.prefix_groups, vocab)
    suffixes = random_prompts(rng, [args.prefix_suffix] * args.prefix_requests, vocab)
    prompts = [systems[i % args.prefix_groups] + s for i, s in enumerate(suffixes)]
    outputs = [args.prefix_output] * len(prompts)
    off = run_requests(core, log, prompts, outputs, [f"ns{i}" for i in range(len(prompts))])
    core.flush_cache()
    on = run_requests(core, log, prompts, outputs)
    core.flush_cache()
    table.add(f"{label} shared prefix ({args.prefix_groups} x {args.prefix_len}-token system "
              f"prompts, {args.prefix_requests} requests)",
              f"{off.elapsed / on.elapsed:.2f}x faster with the radix cache",
              f"on {on.elapsed:.2f} s, off {off.elapsed:.2f} s", None, "paper: up to 6.4x")
    if args.profile:
        profile_decode(core, log, rng, vocab, args)
    del core, runner
    release(args)


def profile_decode(core, log, rng, vocab, args) -> None:
    from torch.profiler import ProfilerActivity, profile

    batch = 64 if args.scale == "full" else 8
    run_requests(core, log, random_prompts(rng, [args.context] * batch, vocab), [4] * batch)
    core.flush_cache()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run_requests(core, log, random_prompts(rng, [args.context] * batch, vocab), [6] * batch)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"\nprofile: batch {batch} (prefill + 6 decode steps)\n"
          f"{prof.key_averages().table(sort_by=sort, row_limit=15)}")
    core.flush_cache()


def bench_small(args, table: Table, rng: random.Random) -> None:
    name = "qwen3-0.6b"
    model_dir = write_model(name, args)
    label = f"{name}{' (tiny)' if args.scale == 'tiny' else ''}"
    for overlap in (False, True):
        core, log = make_core(model_dir, args, overlap=overlap,
                              max_running=max(args.small_batches))
        for batch, sampling in itertools.product(args.small_batches, args.small_sampling):
            run = run_requests(core, log,
                               random_prompts(rng, [args.context] * batch, core.runner.vocab_size),
                               [args.decode_steps] * batch, sampling=sampling)
            wall, device, host = decode_phase(core, log, run, batch)
            how = "" if args.small_sampling == ["greedy"] else f", {sampling}"
            table.add(f"{label} decode, batch {batch}{how}, overlap {'on' if overlap else 'off'}",
                      f"step {wall * 1e3:.2f} ms: host {host * 1e3:.2f} ms, "
                      f"device {device * 1e3:.2f} ms", "", None,
                      "host hidden under device at batch 256" if batch > 1 else "")
            core.flush_cache()
        del core
        release(args)


def release(args) -> None:
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=PRESETS, default="gpu" if torch.cuda.is_available()
                   else "cpu", help="default sizes (default: gpu when CUDA is available)")
    p.add_argument("--device", choices=("cuda", "cpu"))
    p.add_argument("--backend", help="attention backend (default: flashinfer on cuda, torch)")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--scale", choices=("full", "tiny"), help="model sizes (default: preset)")
    p.add_argument("--context-length", type=int, default=None, help="cap the model's context")
    for key, value in PRESETS["gpu"].items():
        if key == "scale":
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, list):
            p.add_argument(flag, type=int, nargs="+", default=None)
        else:
            p.add_argument(flag, type=int, default=None)
    p.add_argument("--cpu-kv-tokens", type=int, default=32768, help="KV pool size on CPU")
    p.add_argument("--profile", action="store_true", help="profile decode steps (batch 64)")
    p.add_argument("--skip-small", action="store_true", help="skip the Qwen3-0.6B rows")
    p.add_argument("--small-sampling", nargs="+", choices=tuple(SAMPLING), default=["greedy"],
                   help="the Qwen3-0.6B rows' sampling: greedy and/or top-p (0.95, no top-k)")
    p.add_argument("--skip-llama", action="store_true",
                   help="skip the Llama-3.1-8B rows (decode, prefill, serving, shared prefix)")
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args()
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.backend = args.backend or ("flashinfer" if args.device == "cuda" else "torch")
    if args.context_length is None:
        args.context_length = max(args.context + args.decode_steps,
                                  args.prefix_len + args.prefix_suffix + args.prefix_output,
                                  int(args.serve_input * 1.5) + int(args.serve_output * 1.5),
                                  args.prefill_tokens) + 16
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    rng = random.Random(0)
    table = Table()
    bandwidth = memory_bandwidth(device, args.copy_mib)
    flops = matmul_rate(device, dtype, args.matmul_n)
    table.add("memory bandwidth (device-to-device copy)", f"{bandwidth / 1e9:,.1f} GB/s")
    table.add(f"matmul rate ({str(dtype).removeprefix('torch.')}, n={args.matmul_n})",
              f"{flops / 1e12:,.2f} TFLOP/s")
    if not args.skip_llama:
        bench_llama(args, table, bandwidth, flops, rng)
    if not args.skip_small:
        bench_small(args, table, rng)
    header = [
        f"# device: {name}; attention backend: {args.backend}; "
        f"CUDA graphs: {'off' if args.disable_cuda_graph or device.type != 'cuda' else 'on'}; "
        f"dtype: {str(dtype).removeprefix('torch.')}; page size {args.page_size}",
        f"# date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"torch {torch.__version__}",
        f"# command: python bench/gpu.py {' '.join(sys.argv[1:])}",
    ]
    if device.type == "cpu":
        header.insert(0, "# CPU, tiny model, not a GPU figure: the fractions are of this CPU's "
                         "own copy bandwidth and matmul rate")
    text = "\n".join(header) + "\n" + table.render() + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
