"""`radixpool` command line: one entry point, a subcommand per job.

Each component registers its subcommands from a torch-free module, so `radixpool gateway` and
`radixpool operator` start without importing torch; heavy imports happen inside the command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# Modules exposing `register(subparsers)`; each adds parsers whose `func(args) -> int` runs the job.
COMMAND_MODULES = (
    "radixpool.worker.cli",
    "radixpool.operator.cli",
    "radixpool.gateway.cli",
    "radixpool.fleet.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixpool",
        description="Serve LLMs with fleet-wide prefix caching: workers, gateway, operator.",
    )
    parser.add_argument("--version", action="version", version=f"radixpool {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("radixpool")
    except PackageNotFoundError:
        return "0+unknown"


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
