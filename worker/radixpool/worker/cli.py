"""Worker subcommands: `tiny-model` (and, as they land, `generate` and `worker`)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from radixpool.worker.tiny_model import ARCHS

    p = subparsers.add_parser(
        "tiny-model",
        help="write a tiny random-weight model with a locally trained tokenizer",
        description="Write a random-weight model of a real architecture (small dimensions) and "
                    "a BPE tokenizer trained locally, in Hugging Face format. Deterministic for a "
                    "seed.")
    p.add_argument("dir", help="output directory")
    p.add_argument("--arch", choices=ARCHS, default="llama", help="architecture (default: llama)")
    p.add_argument("--seed", type=int, default=0, help="random seed for weights and corpus")
    p.set_defaults(func=_tiny_model)
    _register_worker(subparsers)


def _tiny_model(args: argparse.Namespace) -> int:
    from radixpool.worker.tiny_model import make_tiny_model

    path = make_tiny_model(args.dir, args.arch, args.seed)
    print(f"wrote tiny {args.arch} model (seed {args.seed}) to {path}")
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
    from radixpool.worker.server.config import config_from_args
    from radixpool.worker.server.serve import run_worker

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"radixpool worker: error: {exc}")
        return 2
    return run_worker(config)
