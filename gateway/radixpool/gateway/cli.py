"""`radixpool gateway`: flags → a validated frozen config → run.

Defaults come from `GatewayConfig`, so the help text, the docs and the code cannot disagree.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from radixpool.gateway.api_keys import (
    ADMIN_KEY,
    ADMIN_KEY_ENV,
    CLIENT_KEY,
    CLIENT_KEY_ENV,
    WORKER_KEY,
    WORKER_KEY_ENV,
)
from radixpool.gateway.config import POLICIES, GatewayConfig
from radixpool.help_format import HelpFormatter
from radixpool.keys import read_key

D = GatewayConfig()


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "gateway", help="run the cache-aware gateway in front of a pool of workers",
        description="Route OpenAI-compatible and /generate requests to the worker most likely to "
                    "hold the prompt's prefix in KV cache, balanced by load, corrected from the "
                    "workers' own reports.",
        formatter_class=HelpFormatter)
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
    r.add_argument("--late-binding", action=argparse.BooleanOptionalAction,
                   default=D.late_binding,
                   help="hold a request in the gateway while its best worker is saturated, and "
                        "place it when a worker's prefill queue drains")
    r.add_argument("--hold-queued-tokens", type=int, default=D.hold_queued_tokens,
                   help="late binding: a worker with more prefill tokens queued is saturated")
    r.add_argument("--hold-max-requests", type=int, default=D.hold_max_requests,
                   help="late binding: at most this many held (later arrivals bind at once)")
    r.add_argument("--hold-max-seconds", type=float, default=D.hold_max_seconds,
                   help="late binding: a request held this long goes to its soonest worker")
    s = p.add_argument_group("server and fleet")
    s.add_argument("--host", default=D.host,
                   help="listen address (`::`: every IPv6 and IPv4 address, IPv4 only where "
                        "IPv6 is off)")
    s.add_argument("--port", type=int, default=D.port, help="listen port")
    s.add_argument("--api-key-file", default=None, metavar="PATH",
                   help=f"file holding the key clients must send as Authorization: Bearer KEY "
                        f"(without it: ${CLIENT_KEY_ENV}, else no key)")
    s.add_argument("--worker-api-key-file", default=None, metavar="PATH",
                   help=f"file holding the key the gateway presents to workers, their control "
                        f"key (without it: ${WORKER_KEY_ENV}, else the client key)")
    s.add_argument("--admin-api-key-file", default=None, metavar="PATH",
                   help=f"file holding the key that may add and remove workers "
                        f"(without it: ${ADMIN_KEY_ENV}, else nobody may)")
    s.add_argument("--api-key", default=None,
                   help=f"deprecated, visible in the process list: use ${CLIENT_KEY_ENV}")
    s.add_argument("--worker-api-key", default=None,
                   help=f"deprecated, visible in the process list: use ${WORKER_KEY_ENV}")
    s.add_argument("--max-body-bytes", type=int, default=D.max_body_bytes,
                   help="request bodies above this get 413")
    s.add_argument("--large-body-budget-bytes", type=int, default=D.large_body_budget_bytes,
                   help="request bodies over 1 MiB the gateway holds at once, all clients "
                        "together; past it, such a body gets 503 with Retry-After")
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
    s.add_argument("--quarantine-seconds", type=float, default=D.quarantine_seconds,
                   help="refuse a request this long (500 request_quarantined) once two workers' "
                        "engines died holding it; 0 turns it off")
    s.add_argument("--connect-timeout", type=float, default=D.connect_timeout, help="seconds")
    s.add_argument("--drain-timeout", type=float, default=D.drain_timeout, metavar="SECONDS",
                   help="on SIGTERM, how long requests in flight may take to finish (new ones "
                        "get 503 draining meanwhile)")
    s.add_argument("--removed-worker-series-seconds", type=float,
                   default=D.removed_worker_series_seconds,
                   help="a removed worker's /metrics series (and counters) stay this long once "
                        "its last request ended, so scrapes read its final values")
    s.add_argument("--log-level", default=D.log_level,
                   choices=("debug", "info", "warning", "error"))
    e = p.add_argument_group("limits and timeouts (the HTTP edge)")
    e.add_argument("--header-read-timeout", type=float, default=D.header_read_timeout,
                   help="seconds to receive a request's headers (408 after)")
    e.add_argument("--keep-alive-timeout", type=float, default=D.keep_alive_timeout,
                   help="seconds an idle client connection stays open; above the idle timeout "
                        "of any proxy in front that keeps connections to the gateway")
    e.add_argument("--max-header-bytes", type=int, default=D.max_header_bytes,
                   help="request line + headers above this get 431")
    e.add_argument("--body-read-timeout", type=float, default=D.body_read_timeout,
                   help="seconds to receive a request's body (408 after)")
    e.add_argument("--max-connections", type=int, default=D.max_connections,
                   help="client connections open at once (fewer if the open-file limit is "
                        "lower); past it the oldest idle one closes, or 503 if none is idle")
    e.add_argument("--write-stall-timeout", type=float, default=D.write_stall_timeout,
                   help="seconds an answer may wait on a client that reads (almost) none of it "
                        "(under 16 KiB); then "
                        "the connection is dropped (and the worker's request aborted)")
    e.add_argument("--upstream-first-byte-timeout", type=float,
                   default=D.upstream_first_byte_timeout,
                   help="seconds a worker may take to send its response headers (504 after)")
    e.add_argument("--upstream-timeout", type=float, default=D.upstream_timeout,
                   help="seconds a worker may take for a whole response (504, or the stream "
                        "is cut)")
    e.add_argument("--max-route-prompt-chars", type=int, default=D.max_route_prompt_chars,
                   help="the router tokenizes and hashes at most this prefix of a prompt")
    e.add_argument("--parse-processes", type=int, default=D.parse_processes,
                   help="child processes that parse bodies over 16 KiB, off the event loop")
    e.add_argument("--parse-memory-bytes", type=int, default=D.parse_memory_bytes,
                   help="memory one of them may take to parse a body (413 beyond)")
    p.set_defaults(func=_gateway)


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ
                     ) -> tuple[GatewayConfig, list[str]]:
    """The validated config, and warnings for the user (keys given on the command line)."""
    keys, warnings = {}, []
    for source, path, value in ((CLIENT_KEY, args.api_key_file, args.api_key),
                                (WORKER_KEY, args.worker_api_key_file, args.worker_api_key),
                                (ADMIN_KEY, args.admin_api_key_file, None)):
        keys[source.name], warning = read_key(source, path, value, environ)
        if warning:
            warnings.append(warning)
    config = GatewayConfig(
        worker_urls=tuple(args.worker_urls), k8s_service=args.k8s_service,
        namespace=args.namespace, k8s_port_name=args.k8s_port_name, policy=args.policy,
        cache_threshold=args.cache_threshold, balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        hot_prefix_factor=args.hot_prefix_factor, prefix_token_count=args.prefix_token_count,
        prefix_hash_load_factor=args.prefix_hash_load_factor, tokenizer=args.tokenizer,
        host=args.host, port=args.port, api_key=keys["client"], worker_api_key=keys["worker"],
        admin_api_key=keys["admin"], max_body_bytes=args.max_body_bytes,
        large_body_budget_bytes=args.large_body_budget_bytes,
        health_interval=args.health_interval, health_timeout=args.health_timeout,
        health_failures=args.health_failures, health_successes=args.health_successes,
        breaker_failures=args.breaker_failures, breaker_open_seconds=args.breaker_open_seconds,
        max_retries=args.max_retries, quarantine_seconds=args.quarantine_seconds,
        connect_timeout=args.connect_timeout, drain_timeout=args.drain_timeout,
        removed_worker_series_seconds=args.removed_worker_series_seconds,
        kv_events=args.kv_events, late_binding=args.late_binding,
        hold_queued_tokens=args.hold_queued_tokens, hold_max_requests=args.hold_max_requests,
        hold_max_seconds=args.hold_max_seconds, tree_capacity_tokens=args.tree_capacity_tokens,
        text_block_bytes=args.text_block_bytes, log_level=args.log_level,
        header_read_timeout=args.header_read_timeout, keep_alive_timeout=args.keep_alive_timeout,
        max_header_bytes=args.max_header_bytes,
        body_read_timeout=args.body_read_timeout, max_connections=args.max_connections,
        write_stall_timeout=args.write_stall_timeout,
        upstream_first_byte_timeout=args.upstream_first_byte_timeout,
        upstream_timeout=args.upstream_timeout,
        max_route_prompt_chars=args.max_route_prompt_chars,
        parse_processes=args.parse_processes, parse_memory_bytes=args.parse_memory_bytes)
    if config.api_key and not config.worker_api_key:
        warnings.append(f"the gateway presents the client key to workers; set ${WORKER_KEY_ENV} "
                        "to the workers' control key so clients cannot reach their control "
                        "endpoints")
    return config, warnings


def _gateway(args: argparse.Namespace) -> int:
    try:
        config, warnings = config_from_args(args)
    except ValueError as exc:
        print(f"radixpool gateway: {exc}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"radixpool gateway: warning: {warning}", file=sys.stderr)
    if not config.worker_urls and not config.k8s_service:
        how = "POST /workers with the admin key" if config.admin_api_key \
            else f"POST /workers (set ${ADMIN_KEY_ENV} first)"
        print(f"radixpool gateway: starting with no workers; add them with {how}",
              file=sys.stderr)
    from radixpool.gateway.server import run

    return run(config)
