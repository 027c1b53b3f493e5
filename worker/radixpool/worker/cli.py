"""Worker subcommands: `tiny-model`, `generate` (offline) and `worker` (the server)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    from radixpool.worker.tiny_model import ARCHS, TOKENIZERS

    p = subparsers.add_parser(
        "tiny-model",
        help="write a tiny random-weight model with a locally trained tokenizer",
        description="Write a random-weight model of a real architecture (small dimensions) and "
                    "a BPE tokenizer trained locally, in Hugging Face format. Deterministic for a "
                    "seed.")
    p.add_argument("dir", help="output directory")
    p.add_argument("--arch", choices=ARCHS, default="llama", help="architecture (default: llama)")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed for weights and corpus (default: 0)")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="bpe",
                   help="tokenizer style: byte-level BPE (Llama-3/Qwen, the default) or "
                        "SentencePiece-style (Llama-2/Mistral: metaspace with a dummy prefix, "
                        "byte fallback)")
    p.set_defaults(func=_tiny_model)
    _register_generate(subparsers)
    _register_worker(subparsers)


def _tiny_model(args: argparse.Namespace) -> int:
    from radixpool.worker.tiny_model import make_tiny_model

    path = make_tiny_model(args.dir, args.arch, args.seed, args.tokenizer)
    print(f"wrote tiny {args.arch} model (seed {args.seed}, {args.tokenizer} tokenizer) to {path}")
    return 0


def _register_worker(subparsers: argparse._SubParsersAction) -> None:
    from radixpool.worker.server.config import add_worker_arguments

    p = subparsers.add_parser(
        "worker", help="serve a model over HTTP (OpenAI-compatible and native APIs)",
        description="Serve one model with a radix-tree prefix KV cache: OpenAI-compatible "
                    "/v1/chat/completions and /v1/completions, native /generate, Prometheus "
                    "/metrics, KV-cache events for the gateway. SIGTERM drains and exits 0.")
    add_worker_arguments(p)
    p.set_defaults(func=_worker)


def _worker(args: argparse.Namespace) -> int:
    from radixpool.worker.server.config import API_KEY_ENV, config_from_args
    from radixpool.worker.server.serve import run_worker

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"radixpool worker: error: {exc}", file=sys.stderr)
        return 2
    if args.api_key is not None:   # as the gateway warns of its own key flags
        print(f"radixpool worker: warning: --api-key puts the serving key in the process list; "
              f"use ${API_KEY_ENV} instead", file=sys.stderr)
    return run_worker(config)


DEMO_SYSTEM = ("You are a helpful assistant for a radix tree cache. Answer in one short line. "
               "Requests that share this system prompt reuse its KV cache. ")
DEMO_QUESTIONS = ("What is a prefix?", "Why share a cache?", "What does the gateway do?",
                  "How are tokens evicted?")


def _register_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text offline (no server) and show prefix-cache reuse",
        description="Run the engine in this process's child and generate for the prompts given "
                    "(or a built-in set that shares a system prompt), twice, printing each "
                    "completion with its prompt and cached token counts. Without --model it "
                    "uses the built-in tiny model (random weights: the text is gibberish, the "
                    "cache behaviour is real).")
    p.add_argument("prompts", nargs="*", help="prompts (default: a built-in set)")
    p.add_argument("--model", help="model directory (default: the built-in tiny model)")
    p.add_argument("--max-new-tokens", type=int, default=24,
                   help="tokens per completion (default: 24)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    p.add_argument("--rounds", type=int, default=2,
                   help="how many times to send the batch (default 2: the second hits the cache)")
    p.add_argument("--overlap-schedule", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs (default: on for CUDA, off on CPU)")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    import time

    from radixpool.worker import Engine
    from radixpool.worker.tiny_model import default_tiny_model

    model = args.model or str(default_tiny_model())
    prompts = args.prompts or [DEMO_SYSTEM + q for q in DEMO_QUESTIONS]
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "seed": args.seed}
    print(f"loading {model} ...", flush=True)
    try:
        with Engine(model, device=args.device,
                    overlap_schedule=args.overlap_schedule) as engine:
            info = engine.info
            print(f"engine ready: {info.architecture} on {info.device} ({info.dtype}), "
                  f"context {info.context_length}, KV capacity {info.kv_capacity_tokens} tokens")
            for round_no in range(1, args.rounds + 1):
                start = time.perf_counter()
                results = engine.generate(prompts, params)
                elapsed = time.perf_counter() - start
                prompt_total = sum(r["meta_info"]["prompt_tokens"] for r in results)
                cached_total = sum(r["meta_info"]["cached_tokens"] for r in results)
                generated = sum(r["meta_info"]["completion_tokens"] for r in results)
                print(f"\nround {round_no}: {len(results)} prompt{'s' * (len(results) != 1)}, "
                      f"{generated} tokens in {elapsed:.2f} s; cached prompt tokens "
                      f"{cached_total}/{prompt_total}")
                for prompt, r in zip(prompts, results):
                    meta = r["meta_info"]
                    print(f"  [{meta['cached_tokens']:>3}/{meta['prompt_tokens']:<3} cached] "
                          f"{prompt[-40:]!r} -> {r['text'][:60]!r}")
    except ValueError as exc:
        print(f"radixpool generate: error: {exc}")
        return 2
    return 0
