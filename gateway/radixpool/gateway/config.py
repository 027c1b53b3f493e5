"""Gateway configuration: one frozen dataclass, validated once when the CLI builds it.

Defaults are defined here and only here; `cli.py` and `docs/gateway.md` read them from this file.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from radixpool.http_edge import EdgeLimits
from radixpool.listen import http_url

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "prefix_hash")


def normalize_worker_url(url: str) -> str:
    """`host:port` or `http://host:port/` → `http://host:port`, an IPv6 address in brackets and
    in its canonical form (`[FD00:0::5]` is `[fd00::5]`: one worker, one label); raises
    ValueError when unusable."""
    raw = url.strip()
    if "://" not in raw:
        raw = "http://" + raw
    try:
        parts = urlsplit(raw)
    except ValueError as exc:   # a bracketed host that is no IPv6 address
        raise ValueError(f"worker url {url!r}: {exc}") from None
    if parts.scheme != "http":
        raise ValueError(f"worker url {url!r}: only http:// is supported")
    if parts.netloc.count(":") > 1 and "[" not in parts.netloc:
        raise ValueError(f"worker url {url!r}: write an IPv6 address in brackets, "
                         "http://[ADDRESS]:PORT")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ValueError(f"worker url {url!r}: expected http://HOST:PORT")
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(f"worker url {url!r}: must not carry a path or query")
    host = parts.hostname
    if ":" in host:
        try:
            host = ipaddress.IPv6Address(host).compressed
        except ValueError:
            raise ValueError(f"worker url {url!r}: {host!r} is no IPv6 address") from None
    return http_url(host, port)


@dataclass(frozen=True)
class GatewayConfig:
    worker_urls: tuple[str, ...] = ()
    k8s_service: str | None = None
    namespace: str = "default"
    k8s_port_name: str | None = None
    policy: str = "cache_aware"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    hot_prefix_factor: float = 2.0
    prefix_token_count: int = 256
    prefix_hash_load_factor: float = 1.25
    tokenizer: str | None = None
    host: str = "::"   # every address, IPv6 and IPv4 (radixpool.listen)
    port: int = 8080
    api_key: str | None = None          # clients' key
    worker_api_key: str | None = None   # the key presented to workers (their control key)
    admin_api_key: str | None = None    # the key that may change the worker set
    max_body_bytes: int = 32 * 1024 * 1024
    large_body_budget_bytes: int = 256 * 1024 * 1024   # http_edge: bodies over 1 MiB, all at once
    health_interval: float = 2.0
    health_timeout: float = 1.0
    health_failures: int = 3
    health_successes: int = 2
    breaker_failures: int = 5
    breaker_open_seconds: float = 10.0
    max_retries: int = 2
    quarantine_seconds: float = 600.0   # quarantine.py: refuse a query of death this long; 0: off
    removed_worker_series_seconds: float = 600.0   # metrics.py: a gone worker's series stay
    connect_timeout: float = 2.0
    drain_timeout: float = 30.0   # on SIGTERM, how long requests in flight may take to finish
    kv_events: bool = True
    # late binding (wait_queue.py): hold a request while its best worker has more than
    # `hold_queued_tokens` of prefill queued, at most `hold_max_requests` for `hold_max_seconds`
    late_binding: bool = True
    hold_queued_tokens: int = 1024
    hold_max_requests: int = 1024
    hold_max_seconds: float = 5.0
    tree_capacity_tokens: int = 1 << 20
    text_block_bytes: int = 64
    log_level: str = "info"
    # the HTTP edge: limits and deadlines (seconds), by default the workers' own (EdgeLimits)
    header_read_timeout: float = EdgeLimits.header_read_timeout
    keep_alive_timeout: float = 75.0   # an idle client connection stays open this long
    max_header_bytes: int = EdgeLimits.max_header_bytes
    body_read_timeout: float = EdgeLimits.body_read_timeout
    max_connections: int = EdgeLimits.max_connections   # client connections open at once
    write_stall_timeout: float = EdgeLimits.write_stall_timeout   # on a client reading none
    upstream_first_byte_timeout: float = 300.0
    upstream_timeout: float = 1800.0
    max_route_prompt_chars: int = 256 * 1024  # the router tokenizes and hashes this prefix only
    parse_processes: int = 2    # child processes that parse large bodies (body_parsing.py)
    parse_memory_bytes: int = 256 * 1024 * 1024   # what one of them may grow by for a body

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "worker_urls", tuple(normalize_worker_url(u) for u in self.worker_urls))
        if len(set(self.worker_urls)) != len(self.worker_urls):
            raise ValueError("worker_urls: the same worker is listed twice")
        if self.worker_urls and self.k8s_service:
            raise ValueError("use either --worker-urls or --k8s-service, not both")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        _check(0.0 <= self.cache_threshold <= 1.0, "cache_threshold", "within [0, 1]")
        _check(self.balance_abs_threshold >= 0, "balance_abs_threshold", ">= 0")
        _check(self.balance_rel_threshold >= 1.0, "balance_rel_threshold", ">= 1")
        _check(self.hot_prefix_factor > 0, "hot_prefix_factor", "> 0")
        _check(self.prefix_token_count > 0, "prefix_token_count", "> 0")
        _check(self.prefix_hash_load_factor >= 1.0, "prefix_hash_load_factor", ">= 1")
        _check(0 <= self.port < 65536, "port", "within [0, 65535]")
        _check(self.api_key != "", "api_key", "non-empty (omit it to serve without a key)")
        _check(self.worker_api_key != "", "worker_api_key", "non-empty")
        _check(self.admin_api_key != "", "admin_api_key", "non-empty")
        _check(self.admin_api_key is None or self.admin_api_key != self.api_key,
               "admin_api_key", "different from the client api_key")
        _check(self.max_body_bytes > 0, "max_body_bytes", "> 0")
        _check(self.large_body_budget_bytes >= self.max_body_bytes, "large_body_budget_bytes",
               ">= max_body_bytes (else the largest body allowed could never be taken)")
        _check(self.health_interval > 0, "health_interval", "> 0")
        _check(self.health_timeout > 0, "health_timeout", "> 0")
        _check(self.health_failures >= 1, "health_failures", ">= 1")
        _check(self.health_successes >= 1, "health_successes", ">= 1")
        _check(self.breaker_failures >= 1, "breaker_failures", ">= 1")
        _check(self.breaker_open_seconds > 0, "breaker_open_seconds", "> 0")
        _check(self.max_retries >= 0, "max_retries", ">= 0")
        _check(self.quarantine_seconds >= 0, "quarantine_seconds", ">= 0")
        _check(self.removed_worker_series_seconds >= 0, "removed_worker_series_seconds", ">= 0")
        _check(self.connect_timeout > 0, "connect_timeout", "> 0")
        _check(self.drain_timeout >= 0, "drain_timeout", ">= 0")
        _check(self.hold_queued_tokens >= 0, "hold_queued_tokens", ">= 0")
        _check(self.hold_max_requests >= 1, "hold_max_requests", ">= 1")
        _check(self.hold_max_seconds > 0, "hold_max_seconds", "> 0")
        _check(self.tree_capacity_tokens > 0, "tree_capacity_tokens", "> 0")
        _check(self.text_block_bytes > 0, "text_block_bytes", "> 0")
        _check(self.header_read_timeout >= 0.001, "header_read_timeout", ">= 0.001")
        _check(self.keep_alive_timeout >= 0.001, "keep_alive_timeout", ">= 0.001")
        _check(self.max_header_bytes >= 8192, "max_header_bytes", ">= 8192")
        _check(self.max_connections >= 1, "max_connections", ">= 1")
        _check(self.write_stall_timeout > 0, "write_stall_timeout", "> 0")
        _check(self.body_read_timeout > 0, "body_read_timeout", "> 0")
        _check(self.upstream_first_byte_timeout > 0, "upstream_first_byte_timeout", "> 0")
        _check(self.upstream_timeout > 0, "upstream_timeout", "> 0")
        _check(self.max_route_prompt_chars > 0, "max_route_prompt_chars", "> 0")
        _check(self.parse_processes >= 1, "parse_processes", ">= 1")
        _check(self.parse_memory_bytes >= 16 * 1024 * 1024, "parse_memory_bytes", ">= 16 MiB")

    @property
    def upstream_key(self) -> str | None:
        """The key the gateway presents to workers: `worker_api_key`, else its own `api_key`."""
        return self.worker_api_key or self.api_key

    @property
    def static_mode(self) -> bool:
        """Workers come from the command line / admin API rather than Kubernetes."""
        return self.k8s_service is None


def _check(ok: bool, name: str, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}: must be {expected}")
