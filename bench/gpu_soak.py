"""A mixed serving run with the invariant checker on: random lengths, shared prefixes, aborts, and a
share of every sampling feature (grammars, penalties, logprobs, stop strings, seeds).

    python bench/gpu_soak.py --seconds 300                     # on a GPU (FlashInfer, graphs)
    python bench/gpu_soak.py --seconds 20 --device cpu         # the same run, shorter, on CPU
    python bench/gpu_soak.py --features json,stop              # only these features (or "none")

Requests arrive in random bursts; a third of them extend one of a few shared system prompts;
some are aborted while waiting or running (constrained ones also while their grammar compiles).
Half of them carry one feature of `--features` (default all; `soak_mix.py` says what each sends
and checks): a JSON schema or a regex (a finished output must validate / fullmatch; one cut by
its token limit is counted apart), repetition / frequency / presence penalties, logprobs (one per
token, finite, ≤ 0, greedy picks the top one), stop strings and stop token ids (applied as the
engine front end does; the text keeps no stop string), and pairs of seeded requests sent apart
(matches are counted, not required: GPU numerics may depend on the batch). The model dir gets the
tiny model's tokenizer so that grammars compile and outputs decode. By default json and regex are
left out, with a line saying so, where xgrammar or jsonschema is not installed. Arrivals pause while
`--max-live` requests are unfinished: they are drawn per step, at about two a step, which is more
than a step finishes, so without the pause the backlog grows for as long as requests are sent and
the drain after `--seconds` has no bound. A progress line every `--report-every` seconds says how
far a stopped run got. The engine core runs in-process with `debug_invariants`; the checker
(every KV slot free, cached or owned exactly once; lock counts balanced) runs every
`--check-every` steps and whenever the engine drains. At the end every request (those waiting
for a grammar included) must have finished, and after a cache flush the whole KV pool must be
free. It prints what it did, a line per feature, every violation, and exits 1 on any.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file

import torch

from bench.gpu import TINY
from bench.soak_mix import FEATURES, FeatureMix, missing_packages, write_tokenizer


def main(argv: list[str] | None = None) -> int:
    from radixpool.worker.config import EngineConfig
    from radixpool.worker.engine_core import EngineCore
    from radixpool.worker.messages import GenerateRequest
    from radixpool.worker.model.reference_configs import write_reference_config
    from radixpool.worker.sampling_params import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", help="attention backend (default: flashinfer on cuda, torch)")
    p.add_argument("--model", default="qwen3-0.6b", help="reference configuration")
    p.add_argument("--tiny", action="store_true", help="scale the model down (default on CPU)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-cache-tokens", type=int, help="default: mem_fraction on GPU, 16384")
    p.add_argument("--max-len", type=int, default=1024, help="longest prompt")
    p.add_argument("--check-every", type=int, default=50, help="steps between invariant checks")
    p.add_argument("--max-live", type=int, default=256,
                   help="unfinished requests at which arrivals pause")
    p.add_argument("--report-every", type=float, default=30, help="seconds between progress lines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--features", help=f"comma-separated share of the mix: {','.join(FEATURES)}, "
                                      f"or none (default: all this machine can check)")
    args = p.parse_args(argv)
    features, missing = list(FEATURES), missing_packages()
    if args.features is not None:
        features = [f for f in args.features.split(",") if f and f != "none"]
        unknown = sorted(set(features) - set(FEATURES))
        if unknown:
            p.error(f"--features: unknown feature {unknown[0]!r}; expected some of "
                    f"{', '.join(FEATURES)} or none")
        if any(f in missing for f in features):
            p.error("; ".join(f"--features {f} needs {missing[f]}, which is not installed"
                              for f in features if f in missing))
    for feature in [f for f in features if f in missing]:
        print(f"{feature}: not sent (needs {missing[feature]}, not installed here)")
        features.remove(feature)
    cpu = args.device == "cpu"
    # the tokenizer's <s> and </s>: a grammar ends on the model's EOS
    overrides = dict(bos_token_id=1, eos_token_id=2)
    if args.tiny or cpu:   # head dim 64: FlashInfer's, on a GPU; the tokenizer's vocabulary
        overrides = {**TINY, **overrides, "head_dim": 64, "vocab_size": 1024}
    model = write_reference_config(tempfile.mkdtemp(prefix="soak-"), args.model, **overrides)
    text_vocab = write_tokenizer(model)
    core = EngineCore(EngineConfig(
        str(model), device=args.device, random_weights=True, page_size=args.page_size,
        attention_backend=args.backend or ("torch" if cpu else "flashinfer"),
        kv_cache_tokens=args.kv_cache_tokens or (16384 if cpu else None),
        context_length=2 * args.max_len + 512, max_running_requests=64, debug_invariants=True))
    # as a worker does before it says ready: kernels built on first use are built here, not
    # inside the timed run
    t0 = time.perf_counter()
    print(f"warm-up: {core.warm_up()} steps in {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = core.runner.vocab_size
    rng = random.Random(args.seed)
    mix = FeatureMix(features, model, vocab, text_vocab, random.Random(args.seed + 1))
    systems = [[rng.randrange(10, vocab) for _ in range(rng.randint(64, args.max_len // 2))]
               for _ in range(4)]
    live: set[str] = set()
    counts = {"sent": 0, "finished": 0, "aborted": 0, "output_tokens": 0, "steps": 0}
    start = time.perf_counter()
    next_report = args.report_every

    def send(rid: str, prompt: list[int], params: SamplingParams, feature: str | None) -> None:
        seed = counts["sent"]
        if feature is not None:
            seed = mix.track(rid, feature, params, prompt, counts["steps"])
        refused = core.add_request(GenerateRequest(rid, prompt, params, seed=seed))
        if refused is None:
            live.add(rid)
        else:   # refused at once (counted as finished)
            counts["finished"] += 1
            mix.on_delta(refused)
        counts["sent"] += 1

    while time.perf_counter() - start < args.seconds or core.has_work or mix.twins:
        now = time.perf_counter() - start
        if now >= next_report:
            next_report += args.report_every
            print(f"{now:.0f} s: {counts}, unfinished {len(live)}, KV free "
                  f"{core.runner.kv_pool.available_size()}", flush=True)
        sending = now < args.seconds and len(live) < args.max_live
        if sending and (not live or rng.random() < 0.3):
            for _ in range(rng.randint(1, 12)):
                prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(1, args.max_len))]
                if rng.random() < 0.33:
                    prompt = rng.choice(systems) + prompt[:64]
                feature = mix.pick()
                params = mix.params(feature) if feature else SamplingParams(
                    max_new_tokens=rng.randint(1, 128), ignore_eos=True,
                    temperature=rng.choice([0.0, 0.8]))
                send(f"r{counts['sent']}", prompt, params, feature)
        for rid, prompt, params in mix.due_twins(counts["steps"], counts["sent"]):
            send(rid, prompt, params, "seeded")
        if live and rng.random() < 0.02:
            rid = rng.choice(sorted(live))
            core.abort(rid)
            live.discard(rid)
            mix.aborted(rid)
            counts["aborted"] += 1
        for delta in core.step().deltas:
            if delta.rid not in live:
                continue   # aborted here, or ended by a stop string: later tokens are dropped
            counts["output_tokens"] += len(delta.token_ids)
            if mix.on_delta(delta):
                if not delta.finished:
                    core.abort(delta.rid)   # a stop string ended it: the engine does this
                live.discard(delta.rid)
                counts["finished"] += 1
        counts["steps"] += 1
        if counts["steps"] % args.check_every == 0 or not core.has_work:
            core.check_invariants()
    elapsed = time.perf_counter() - start
    core.check_invariants()
    pool = core.runner.kv_pool
    core.flush_cache()
    leaked = pool.capacity - pool.available_size()
    print(f"device {core.runner.device}, backend {core.runner.attention_backend_name}, "
          f"CUDA graphs {'on' if core.runner.decode_graphs else 'off'}, page size "
          f"{args.page_size}, KV {pool.capacity} tokens; {elapsed:.0f} s, {counts}; "
          f"unfinished {len(live)}, KV slots leaked {leaked}, "
          f"double frees {pool.double_frees}")
    for line in mix.summary():
        print(line)
    print("forks: not sent (n > 1 is fanned out by the engine front end, not the core)")
    for violation in mix.violations[:20]:
        print(f"VIOLATION {violation}")
    if len(mix.violations) > 20:
        print(f"... {len(mix.violations)} violations in all")
    ok = not live and not leaked and not pool.double_frees and not mix.violations
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
