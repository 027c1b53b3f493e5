"""`radixpool up` and `radixpool demo`: the whole data plane on one machine."""

from __future__ import annotations

import argparse
import sys

from radixpool.gateway.config import POLICIES
from radixpool.help_format import HelpFormatter
from radixpool.worker.config import DEVICES


def register(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser(
        "up", help="run a local fleet (workers + gateway on loopback) until Ctrl-C",
        description="Start N `radixpool worker` processes and a `radixpool gateway` in front of "
                    "them on 127.0.0.1, print the OpenAI base URL, and on Ctrl-C (or SIGTERM) "
                    "drain and stop everything started. Without --model it serves the built-in "
                    "tiny model (random weights: gibberish text, real caching), made on first use "
                    "in $RADIXPOOL_CACHE_DIR, else $XDG_CACHE_HOME/radixpool, else "
                    "~/.cache/radixpool.",
        formatter_class=HelpFormatter)
    up.add_argument("--model", metavar="DIR", default=None,
                    help="Hugging Face model directory (default: the built-in tiny model)")
    up.add_argument("--served-model-name", metavar="NAME", default=None,
                    help="name clients put in `model` (default: tiny-llama, or the directory's "
                         "name)")
    up.add_argument("--workers", type=int, default=2, help="worker processes")
    up.add_argument("--port", type=int, default=8080, help="gateway port (0: a free one)")
    up.add_argument("--policy", choices=POLICIES, default="cache_aware", help="routing policy")
    up.add_argument("--worker-port-base", type=int, default=None, metavar="PORT",
                    help="worker i listens on PORT+i (default: free ports)")
    up.add_argument("--device", choices=DEVICES, default="auto",
                    help="worker device")
    up.add_argument("--kv-cache-tokens", type=int, default=None, metavar="N",
                    help="KV pool size of each worker in tokens (default: the worker's)")
    up.set_defaults(func=_up)

    demo = subparsers.add_parser(
        "demo", help="show what cache-aware routing buys: a local fleet, two policies, one table",
        description="Start a local fleet of the built-in tiny model, run a shared-prefix and a "
                    "multi-turn workload through the gateway with cache_aware routing and again "
                    "with round_robin, and print throughput, time to first token, the workers' "
                    "actual cache hit rate, the gateway's predicted hit rate and each worker's "
                    "share side by side. Takes about 30 s on an idle 2-core CPU, a minute on "
                    "a busy one.",
        formatter_class=HelpFormatter)
    demo.add_argument("--model", metavar="DIR", default=None,
                      help="model directory (default: the built-in tiny model)")
    demo.add_argument("--workers", type=int, default=None,
                      help="worker processes (default: the demo's own choice)")
    demo.add_argument("--quick", action="store_true",
                      help="a smaller workload (for smoke tests)")
    demo.set_defaults(func=_demo)


def _up(args: argparse.Namespace) -> int:
    from radixpool.fleet.fleet import FleetSpec
    from radixpool.fleet.up import resolve_model, run_up

    try:
        model, builtin_name = resolve_model(args.model)
        spec = FleetSpec(model=model, workers=args.workers, port=args.port, policy=args.policy,
                         worker_port_base=args.worker_port_base,
                         served_model_name=args.served_model_name or builtin_name,
                         device=args.device, kv_cache_tokens=args.kv_cache_tokens)
    except ValueError as exc:
        print(f"radixpool up: {exc}", file=sys.stderr)
        return 2
    return run_up(spec)


def _demo(args: argparse.Namespace) -> int:
    from radixpool.fleet.demo import run_demo

    return run_demo(model=args.model, workers=args.workers, quick=args.quick)
