"""Per-step sampling time of `Sampler.sample`, from logits on the device to token ids in Python.

    python bench/sampler.py [--device cpu|cuda] [--batch 1 64 256] [--vocab 32000 152064]

Workloads per (batch, vocab):
  greedy   every row temperature 0: the single-argmax fast path
  sampled  every row temperature 0.8, top_p 0.95 (no top-k: the top-p candidate window)
  mixed    a quarter each: temperature + top-k 50 + top-p 0.9 (batch 1: this row); greedy;
           temperature + min-p 0.05 with repetition 1.1 / frequency 0.3 penalties (request
           ids: counts kept on the device); top-p 0.9 with 5 top logprobs.
Outputs grow every step.
Logits: `peaked` (default) is LM-like, most mass on a few dozen tokens; `flat` (scaled Gaussian)
spreads top-p 0.95 over thousands of tokens, so the top-p candidate window has to widen.
Prints the median and the best step time (ms) over the timed steps: on a shared machine the best is
the better estimate of the cost, the median of what a step met.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixpool.worker.sampler import Sampler, SamplingRow
from radixpool.worker.sampling_params import SamplingParams

WORKLOADS = {
    "greedy": [SamplingParams(temperature=0)],
    "sampled": [SamplingParams(temperature=0.8, top_p=0.95)],
    "mixed": [
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.1,
                       frequency_penalty=0.3),
        SamplingParams(temperature=0.9, top_p=0.9, logprobs=5),
    ],
}


def make_logits(batch: int, vocab: int, shape: str, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=generator) * (3.0 if shape == "flat" else 2.0)
    if shape == "peaked":
        favourites = torch.randint(vocab, (batch, 32), generator=generator)
        logits.scatter_add_(1, favourites, torch.full((batch, 32), 11.0))
    return logits.to(device)


def bench(device: torch.device, batch: int, vocab: int, workload: str, shape: str, steps: int,
          budget_s: float) -> tuple[float, float]:
    sampler = Sampler(vocab, (2,), device)
    kinds = WORKLOADS[workload]
    prompt = list(range(3, 515))
    rows = [SamplingRow(kinds[i % len(kinds)], seed=i, prompt_ids=prompt, output_ids=[],
                        key=f"req{i}") for i in range(batch)]
    logits = make_logits(batch, vocab, shape, device)
    times = []
    started = time.perf_counter()
    for step in range(steps + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = sampler.sample(logits, rows).token_ids
        elapsed = time.perf_counter() - t0
        if step >= 3:  # warm-up: allocator, kernels, penalty slots
            times.append(elapsed)
        for row, token in zip(rows, tokens, strict=True):
            row.output_ids.append(token)
        if time.perf_counter() - started > budget_s and len(times) >= 3:
            break
    return statistics.median(times) * 1e3, min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 152064])
    parser.add_argument("--logits", choices=("peaked", "flat"), default="peaked")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--budget", type=float, default=10.0, help="seconds per configuration")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"logits {args.logits}")
    print(f"{'vocab':>7} {'batch':>5} " + " ".join(f"{w + ' med/best':>20}" for w in WORKLOADS))
    for vocab in args.vocab:
        for batch in args.batch:
            cells = [bench(device, batch, vocab, w, args.logits, args.steps, args.budget)
                     for w in WORKLOADS]
            text = " ".join(f"{f'{m:.3f}/{b:.3f}':>20}" for m, b in cells)
            print(f"{vocab:>7} {batch:>5} {text}", flush=True)


if __name__ == "__main__":
    main()
