"""Structured-output benchmark: jump-forward, and what grammar masks cost a decode step.

    python bench/structured.py jump [--model DIR] [--requests 64] [--device cpu]
    python bench/structured.py mask [--model DIR] [--batch 64] [--constrained 0 8 64] [--steps 40]

`jump` runs the engine core in-process on a JSON-schema workload (objects with several keys:
enums, bounded integers, short patterned strings — the forced text is the keys, the punctuation
and the rest of an enum value once its first token is chosen), greedy and sampled (T=1), in each
jump-forward mode (off, retokenize, exact), and prints engine steps (batched forward passes),
request passes (forward passes summed over the requests: what one request alone would take),
generated tokens, tokens per request pass, wall time and generated tokens/s (the fastest of
`--repeat` runs, modes interleaved), and whether every output is token for token the one of mode
off; every output is checked against the schema. `--requests 1` gives the single-request case.

`mask` decodes a batch of `--batch` requests of which `--constrained` carry a JSON schema with an
unbounded language (an array of at least 1,000 integers: they never finish early), jump-forward
off so every step is one token, and prints the decode step time (median and min), the sampler
phase (masks applied there), and the time to build the step's masks (bitmasks filled by xgrammar,
special tokens cleared, unpacked to a boolean mask), in total and per constrained request.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

JUMP_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["status", "priority", "owner", "retries", "region"],
    "properties": {
        "status": {"enum": ["queued", "running", "finished", "failed"]},
        "priority": {"type": "integer", "minimum": 0, "maximum": 9},
        "owner": {"type": "string", "pattern": "^[a-z]{2,6}$"},
        "retries": {"type": "integer", "minimum": 0, "maximum": 3},
        "region": {"enum": ["north", "south", "east", "west"]},
    },
}
MASK_SCHEMA = {"type": "array", "minItems": 1000,
               "items": {"type": "integer", "minimum": 0, "maximum": 999}}


def _model(path: str | None) -> str:
    from radixpool.worker.tiny_model import default_tiny_model

    return path or str(default_tiny_model())


def _core(model: str, device: str, **options):
    from radixpool.worker.config import EngineConfig
    from radixpool.worker.engine_core import EngineCore

    return EngineCore(EngineConfig(model, device=device, kv_cache_tokens=65536, **options))


def _run(core, requests) -> tuple[dict[str, list[int]], int]:
    """Every request's tokens, and the forward passes the requests took (summed over them)."""
    from radixpool.worker.messages import GenerateRequest

    out, passes = {}, 0
    for rid, ids, params, seed in requests:
        core.add_request(GenerateRequest(rid, ids, params, seed))
        out[rid] = []
    while core.has_work:
        for delta in core.step().deltas:
            out[delta.rid] += delta.token_ids
            passes += bool(delta.token_ids)   # one delta per pass that sampled for it
    return out, passes


def jump(args: argparse.Namespace) -> None:
    import jsonschema

    from radixpool.tokenization import PromptTokenizer
    from radixpool.worker.sampling_params import SamplingParams

    model = _model(args.model)
    tok = PromptTokenizer.from_dir(model)
    schema = json.dumps(JUMP_SCHEMA)
    warm = _core(model, args.device)
    print(f"JSON-schema workload: {args.requests} requests, 5 keys, device {args.device}")
    print(f"{'sampling':>8} {'jump-forward':>12} {'engine steps':>13} {'request passes':>15} "
          f"{'tokens':>7} {'tokens/pass':>12} {'wall s':>7} {'tokens/s':>9} {'same as off':>12}")
    for temperature in (0.0, 1.0):
        requests = [(f"r{i}", tok.encode(f"job {i}: describe it as JSON"), SamplingParams(
            max_new_tokens=120, temperature=temperature, json_schema=schema), i)
            for i in range(args.requests)]
        _run(warm, requests[:2])   # xgrammar import, tokenizer info, compile: not measured
        results: dict[str, tuple] = {}
        walls: dict[str, float] = {}
        for _ in range(args.repeat):   # modes interleaved: a load change hits them all
            for mode in ("off", "retokenize", "exact"):
                core = _core(model, args.device, jump_forward=mode)
                core.grammars.compiler = warm.grammars.compiler   # compiled: time decoding
                start = time.perf_counter()
                out, passes = _run(core, requests)
                walls[mode] = min(walls.get(mode, math.inf), time.perf_counter() - start)
                results[mode] = (out, core.times.steps, passes)
        for mode, (out, steps, passes) in results.items():
            for ids in out.values():
                jsonschema.validate(json.loads(tok.tokenizer.decode(ids[:-1])), JUMP_SCHEMA)
            tokens, wall = sum(len(ids) for ids in out.values()), walls[mode]
            print(f"{'greedy' if temperature == 0 else 'T=1':>8} {mode:>12} {steps:>13} "
                  f"{passes:>15} {tokens:>7} {tokens / passes:>12.2f} {wall:>7.2f} "
                  f"{tokens / wall:>9.0f} {str(out == results['off'][0]).lower():>12}")


def mask(args: argparse.Namespace) -> None:
    from radixpool.worker.messages import GenerateRequest
    from radixpool.worker.sampling_params import SamplingParams

    model = _model(args.model)
    schema = json.dumps(MASK_SCHEMA)
    print(f"decode step, batch {args.batch}, {args.steps} steps measured, device {args.device}")
    print(f"{'constrained':>11} {'step ms p50':>12} {'step ms min':>12} {'sample ms p50':>14} "
          f"{'masks ms p50':>13} {'us per mask':>12}")
    from radixpool.worker.grammar.mask import GrammarMasks

    build = GrammarMasks.build
    mask_times: list[float] = []

    def timed_build(self, grammars, drafts=None):
        t = time.perf_counter()
        out = build(self, grammars, drafts)
        mask_times.append(time.perf_counter() - t)
        return out

    GrammarMasks.build = timed_build
    for constrained in args.constrained:
        core = _core(model, args.device, jump_forward="off",
                     max_running_requests=max(args.batch, 1))
        for i in range(args.batch):
            params = SamplingParams(max_new_tokens=args.steps + 8, temperature=1.0,
                                    ignore_eos=i >= constrained,
                                    json_schema=schema if i < constrained else None)
            core.add_request(GenerateRequest(f"r{i}", [5 + i, 6, 7, 8], params, i))
        while len(core.scheduler.running) < args.batch or core.grammars:
            core.step()
        core.step()
        steps, samples = [], []
        mask_times.clear()
        for _ in range(args.steps):
            before = core.times.sample
            t = time.perf_counter()
            core.step()
            steps.append(time.perf_counter() - t)
            samples.append(core.times.sample - before)
        step, sample = statistics.median(steps) * 1e3, statistics.median(samples) * 1e3
        masks = statistics.median(mask_times) * 1e3 if mask_times else 0.0
        per_mask = f"{masks * 1e3 / constrained:.1f}" if constrained else ""
        print(f"{constrained:>11} {step:>12.2f} {min(steps) * 1e3:>12.2f} {sample:>14.2f} "
              f"{masks:>13.3f} {per_mask:>12}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    j = sub.add_parser("jump")
    j.add_argument("--model")
    j.add_argument("--requests", type=int, default=64)
    j.add_argument("--device", default="cpu")
    j.add_argument("--repeat", type=int, default=3, help="runs per mode; the fastest is shown")
    m = sub.add_parser("mask")
    m.add_argument("--model")
    m.add_argument("--batch", type=int, default=64)
    m.add_argument("--constrained", type=int, nargs="+", default=[0, 8, 64])
    m.add_argument("--steps", type=int, default=40)
    m.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    {"jump": jump, "mask": mask}[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
