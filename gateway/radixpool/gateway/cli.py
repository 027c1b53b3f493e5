"""`radixpool gateway`: flags → a validated frozen config → run.

Defaults come from `GatewayConfig`, so the help text, the docs and the code cannot disagree.
"""

from __future__ import annotations

import argparse
import sys

from radixpool.gateway.config import POLICIES, GatewayConfig

D = GatewayConfig()


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "gateway", help="run the cache-aware gateway in front of a pool of workers",
        description="Route OpenAI-compatible and /generate requests to the worker most likely to "
                    "hold the prompt's prefix in KV cache, balanced by load, corrected from the "
                    "workers' own reports.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_argument_group("workers")
    src.add_argument("--worker-urls", nargs="+", default=[], metavar="URL",
                     help="static worker list (http://HOST:PORT ...)")
    src.add_argument("--k8s-service", default=None, metavar="NAME",
                     help="discover workers from this Service's EndpointSlices (watched)")
    src.add_argument("--namespace", default=D.namespace, help="namespace of --k8s-service")
    src.add_argument("--k8s-port-name", default=D.k8s_port_name,
                     help="EndpointSlice port name to use (default: the first port)")
    r = p.add_argument_group("routing")
    r.add_argument("--policy", choices=POLICIES, default=D.policy)
    r.add_argument("--cache-threshold", type=float, default=D.cache_threshold,
                   help="match ratio (beyond the shared base) above which cache affinity wins")
    r.add_argument("--balance-abs-threshold", type=int, default=D.balance_abs_threshold,
                   help="in-flight gap (max-min) that, with the relative one, means imbalance")
    r.add_argument("--balance-rel-threshold", type=float, default=D.balance_rel_threshold,
                   help="in-flight ratio (max/min) that, with the absolute one, means imbalance")
    r.add_argument("--hot-prefix-factor", type=float, default=D.hot_prefix_factor,
                   help="a prefix carrying this many workers' share of traffic is replicated, "
                        "not pinned")
    r.add_argument("--prefix-token-count", type=int, default=D.prefix_token_count,
                   help="tokens hashed by --policy prefix_hash")
    r.add_argument("--prefix-hash-load-factor", type=float, default=D.prefix_hash_load_factor,
                   help="prefix_hash skips a worker above this multiple of the mean load")
    r.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="model tokenizer directory (default: fetched from a worker's /tokenizer)")
    r.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="do not follow the workers' /kv_events streams")
    r.add_argument("--tree-capacity-tokens", type=int, default=D.tree_capacity_tokens,
                   help="tree bound per worker until its /server_info reports KV capacity")
    r.add_argument("--text-block-bytes", type=int, default=D.text_block_bytes,
                   help="block size when routing on text (no tokenizer)")
    s = p.add_argument_group("server and fleet")
    s.add_argument("--host", default=D.host)
    s.add_argument("--port", type=int, default=D.port)
    s.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    s.add_argument("--worker-api-key", default=None,
                   help="key the gateway presents to workers (default: --api-key)")
    s.add_argument("--max-body-bytes", type=int, default=D.max_body_bytes)
    s.add_argument("--health-interval", type=float, default=D.health_interval, help="seconds")
    s.add_argument("--health-timeout", type=float, default=D.health_timeout, help="seconds")
    s.add_argument("--health-failures", type=int, default=D.health_failures,
                   help="consecutive failed checks that take a worker down")
    s.add_argument("--health-successes", type=int, default=D.health_successes,
                   help="consecutive good checks that bring it back")
    s.add_argument("--breaker-failures", type=int, default=D.breaker_failures,
                   help="consecutive failed requests that open a worker's circuit breaker")
    s.add_argument("--breaker-open-seconds", type=float, default=D.breaker_open_seconds,
                   help="how long the breaker stays open before a half-open probe")
    s.add_argument("--max-retries", type=int, default=D.max_retries,
                   help="retries on another worker (connect errors, 503 before the first byte)")
    s.add_argument("--connect-timeout", type=float, default=D.connect_timeout, help="seconds")
    s.add_argument("--log-level", default=D.log_level,
                   choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_gateway)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        worker_urls=tuple(args.worker_urls), k8s_service=args.k8s_service,
        namespace=args.namespace, k8s_port_name=args.k8s_port_name, policy=args.policy,
        cache_threshold=args.cache_threshold, balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        hot_prefix_factor=args.hot_prefix_factor, prefix_token_count=args.prefix_token_count,
        prefix_hash_load_factor=args.prefix_hash_load_factor, tokenizer=args.tokenizer,
        host=args.host, port=args.port, api_key=args.api_key, worker_api_key=args.worker_api_key,
        max_body_bytes=args.max_body_bytes,
        health_interval=args.health_interval, health_timeout=args.health_timeout,
        health_failures=args.health_failures, health_successes=args.health_successes,
        breaker_failures=args.breaker_failures, breaker_open_seconds=args.breaker_open_seconds,
        max_retries=args.max_retries, connect_timeout=args.connect_timeout,
        kv_events=args.kv_events, tree_capacity_tokens=args.tree_capacity_tokens,
        text_block_bytes=args.text_block_bytes, log_level=args.log_level)


def _gateway(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"radixpool gateway: {exc}", file=sys.stderr)
        return 2
    if not config.worker_urls and not config.k8s_service:
        print("radixpool gateway: starting with no workers; add them with POST /workers",
              file=sys.stderr)
    from radixpool.gateway.server import run

    return run(config)
