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


def _tiny_model(args: argparse.Namespace) -> int:
    from radixpool.worker.tiny_model import make_tiny_model

    path = make_tiny_model(args.dir, args.arch, args.seed)
    print(f"wrote tiny {args.arch} model (seed {args.seed}) to {path}")
    return 0
