"""Prometheus metric names: a contract with the dashboards, the docs and the operators' alerts.

Components build their collectors from these specs; `tests/test_dashboards.py` checks that every
series a dashboard queries is one of them. Names follow Prometheus conventions: counters end in
`_total`, units are base units (seconds, tokens, ratio).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram", "info"]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()

    @property
    def series(self) -> tuple[str, ...]:
        """The sample names Prometheus exposes for this metric."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        if self.kind == "info":
            return (f"{self.name}_info",)
        return (self.name,)


# From a token gap (milliseconds) to the longest request the gateway lets run (its default
# --upstream-timeout, 30 min; the first byte may take 5): above the top bound histogram_quantile
# can only answer the bound itself, so a 20-minute p99 would read as the bound.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
    180.0, 300.0, 600.0, 1200.0, 1800.0,
)
# Grammar compiles take from well under a millisecond to seconds (large schemas).
GRAMMAR_COMPILE_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

# --- worker -----------------------------------------------------------------------------------
PROMPT_TOKENS = MetricSpec(
    "radixpool_prompt_tokens_total", "counter",
    "Prompt tokens of finished requests, and of aborted ones that had their first token (per "
    "choice: an n>1 request counts its prompt n times).")
CACHED_PROMPT_TOKENS = MetricSpec(
    "radixpool_cached_prompt_tokens_total", "counter",
    "Prompt tokens served from the radix KV cache instead of being computed.")
GENERATION_TOKENS = MetricSpec(
    "radixpool_generation_tokens_total", "counter",
    "Tokens generated, by finished and aborted requests.")
REQUESTS = MetricSpec(
    "radixpool_requests_total", "counter",
    "Finished requests by finish reason (per choice: an n>1 request counts n).",
    ("finish_reason",))
RETRACTED_REQUESTS = MetricSpec(
    "radixpool_retracted_requests_total", "counter",
    "Running requests sent back to the queue because KV memory ran out.")
RADIX_EVICTED_TOKENS = MetricSpec(
    "radixpool_radix_evicted_tokens_total", "counter",
    "Tokens evicted from the radix cache to make room.")
KV_DOUBLE_FREES = MetricSpec(
    "radixpool_kv_double_frees_total", "counter",
    "KV pages freed while already free (an engine bug; the page is not handed out twice).")
NONFINITE_LOGITS = MetricSpec(
    "radixpool_nonfinite_logits_total", "counter",
    "Requests aborted because the model produced NaN or infinite logits for them (fp16 "
    "overflow, a bad checkpoint, a kernel bug).")
NONFINITE_BROKEN = MetricSpec(
    "radixpool_nonfinite_logits_broken", "gauge",
    "1 once the last --unhealthy-after-nonfinite requests and a self-check request all ended "
    "with non-finite logits: the model is broken on this worker, /health and /livez answer 503 "
    "until it restarts.")
NUM_REQUESTS_RUNNING = MetricSpec(
    "radixpool_num_requests_running", "gauge", "Requests in the running batch.")
NUM_REQUESTS_WAITING = MetricSpec(
    "radixpool_num_requests_waiting", "gauge", "Requests waiting for admission.")
KV_CACHE_USAGE = MetricSpec(
    "radixpool_kv_cache_usage_ratio", "gauge",
    "Fraction of KV slots in use by running requests or the radix cache.")
KV_CACHE_CAPACITY = MetricSpec(
    "radixpool_kv_cache_capacity_tokens", "gauge", "KV pool capacity in tokens.")
RADIX_CACHE_TOKENS = MetricSpec(
    "radixpool_radix_cache_tokens", "gauge", "Tokens held by the radix cache.")
KV_CACHE_EVICTABLE = MetricSpec(
    "radixpool_kv_cache_evictable_tokens", "gauge",
    "Tokens of the radix cache no running request uses: evicted on demand, so free to new "
    "requests (a warm worker's usage ratio stays near 1; this much of it is cache).")
CACHE_HIT_RATE = MetricSpec(
    "radixpool_cache_hit_rate", "gauge",
    "Cached / prompt tokens over the recent window of finished requests.")
TIME_TO_FIRST_TOKEN = MetricSpec(
    "radixpool_time_to_first_token_seconds", "histogram", "Time from arrival to first token.")
INTER_TOKEN_LATENCY = MetricSpec(
    "radixpool_inter_token_latency_seconds", "histogram",
    "Time between generated tokens: one observation per token after a choice's first.")
E2E_REQUEST_LATENCY = MetricSpec(
    "radixpool_e2e_request_latency_seconds", "histogram", "Time from arrival to finish.")
QUEUE_TIME = MetricSpec(
    "radixpool_queue_time_seconds", "histogram", "Time from arrival to first admission.")
GRAMMAR_COMPILE_SECONDS = MetricSpec(
    "radixpool_grammar_compile_seconds", "histogram",
    "Time to compile a structured-output constraint (JSON schema, regex, EBNF); cache hits "
    "are not compiled.")
GRAMMAR_CACHE_HITS = MetricSpec(
    "radixpool_grammar_cache_hits_total", "counter",
    "Constrained requests whose grammar was already compiled (or compiling) in the cache.")
WORKER_INFO = MetricSpec(
    "radixpool_worker", "info", "Model, version and instance id of this worker.",
    ("model", "version", "instance_id"))

WORKER_METRICS: tuple[MetricSpec, ...] = (
    PROMPT_TOKENS, CACHED_PROMPT_TOKENS, GENERATION_TOKENS, REQUESTS, RETRACTED_REQUESTS,
    RADIX_EVICTED_TOKENS, KV_DOUBLE_FREES, NONFINITE_LOGITS, NONFINITE_BROKEN,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING, KV_CACHE_USAGE, KV_CACHE_CAPACITY, RADIX_CACHE_TOKENS,
    KV_CACHE_EVICTABLE, CACHE_HIT_RATE,
    TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_REQUEST_LATENCY, QUEUE_TIME,
    GRAMMAR_COMPILE_SECONDS, GRAMMAR_CACHE_HITS, WORKER_INFO,
)

# --- gateway ----------------------------------------------------------------------------------
GW_REQUESTS = MetricSpec(
    "radixpool_gateway_requests_total", "counter",
    "Routed requests by worker and status code (worker=\"gateway\": answered by the gateway; "
    "code 499: the client left before its answer was whole; a 200 stream that ended in an "
    "error event counts under the error's status, 4xx or 5xx, e.g. 500 for a server_error).",
    ("worker", "code"))
GW_ROUTE_DECISIONS = MetricSpec(
    "radixpool_gateway_route_decisions_total", "counter",
    "Routing decisions by chosen worker and reason (cache_hit, cache_miss, imbalance, spill, "
    "late, retry, ...).",
    ("worker", "reason"))
GW_INFLIGHT = MetricSpec(
    "radixpool_gateway_inflight_requests", "gauge", "Requests in flight per worker.", ("worker",))
GW_WORKER_HEALTHY = MetricSpec(
    "radixpool_gateway_worker_healthy", "gauge",
    "1 when the worker passes its health checks and is neither draining nor terminating (its "
    "circuit breaker is radixpool_gateway_breaker_state).", ("worker",))
GW_BREAKER_STATE = MetricSpec(
    "radixpool_gateway_breaker_state", "gauge",
    "The worker's circuit breaker: 1 on its current state (closed, open, half_open), 0 on the "
    "others. An open breaker sends the worker no traffic, healthy or not.", ("worker", "state"))
GW_WORKER_INFO = MetricSpec(
    "radixpool_gateway_worker", "info",
    "1 for each worker the gateway has series of: `worker` (its address, the label of the other "
    "radixpool_gateway_* series) and `worker_pod`, its pod's name as its EndpointSlice names it "
    "(the `pod` label of the worker's own series), else, for a worker given by --worker-urls or "
    "the admin API, its host:port. Join on `worker` to show pods.",
    ("worker", "worker_pod"))
GW_PROMPT_TOKENS = MetricSpec(
    "radixpool_gateway_prompt_tokens_total", "counter",
    "Prompt tokens of answered requests, as the workers reported them.", ("worker",))
GW_CACHED_TOKENS = MetricSpec(
    "radixpool_gateway_cached_tokens_total", "counter",
    "Cached prompt tokens the workers actually reported.", ("worker",))
GW_PREDICTED_CACHED_TOKENS = MetricSpec(
    "radixpool_gateway_predicted_cached_tokens_total", "counter",
    "Cached prompt tokens the gateway's prefix tree predicted when it routed.", ("worker",))
GW_TREE_TOKENS = MetricSpec(
    "radixpool_gateway_tree_tokens", "gauge",
    "Tokens (or prompt bytes, without a tokenizer) in the gateway's tree for the worker.",
    ("worker",))
GW_RETRIES = MetricSpec(
    "radixpool_gateway_retries_total", "counter",
    "Retries on another worker (a request tried three times counts 2).")
GW_QUARANTINED = MetricSpec(
    "radixpool_gateway_quarantined_requests_total", "counter",
    "Requests refused because two workers' engines died while holding the same request "
    "(a query of death).")
GW_REQUEST_DURATION = MetricSpec(
    "radixpool_gateway_request_duration_seconds", "histogram",
    "Time from request arrival at the gateway to the last byte.")
GW_TIME_TO_FIRST_TOKEN = MetricSpec(
    "radixpool_gateway_time_to_first_token_seconds", "histogram",
    "Time from request arrival at the gateway to a streamed response's first event (its "
    "first token), also for streams the client leaves; whole answers are in request_duration "
    "only.")
GW_HIT_RATE = MetricSpec(
    "radixpool_gateway_hit_rate", "gauge",
    "Cached / prompt tokens since start, kind=actual (workers' reports) or predicted (the "
    "gateway's trees); worker=\"all\" is the fleet, removed workers included.",
    ("worker", "kind"))
GW_TREE_CORRECTIONS = MetricSpec(
    "radixpool_gateway_tree_corrections_total", "counter",
    "Times a worker's tree was corrected from ground truth, by source (cached_tokens, "
    "instance_id, kv_resync).", ("worker", "source"))
GW_UPSTREAM_TIMEOUTS = MetricSpec(
    "radixpool_gateway_upstream_timeouts_total", "counter",
    "Requests cut because the worker sent no headers or did not finish within its deadline.",
    ("worker",))
GW_WAIT_QUEUE = MetricSpec(
    "radixpool_gateway_wait_queue_requests", "gauge",
    "Requests the gateway holds in its wait queue (late binding) until a worker can take them.")
GW_WAIT_QUEUE_OUTCOMES = MetricSpec(
    "radixpool_gateway_wait_queue_outcomes_total", "counter",
    "Requests that left the wait queue, by outcome (placed; overdue: sent at the deadline to a "
    "saturated worker; left: the client disconnected; rejected: 503, no worker at the deadline "
    "or still held when the gateway's drain ended).",
    ("outcome",))
GW_WAIT_QUEUE_SECONDS = MetricSpec(
    "radixpool_gateway_wait_queue_seconds", "histogram",
    "Time requests spent held in the wait queue.")

GATEWAY_METRICS: tuple[MetricSpec, ...] = (
    GW_REQUESTS, GW_ROUTE_DECISIONS, GW_INFLIGHT, GW_WORKER_HEALTHY, GW_BREAKER_STATE,
    GW_WORKER_INFO, GW_PROMPT_TOKENS,
    GW_CACHED_TOKENS, GW_PREDICTED_CACHED_TOKENS, GW_TREE_TOKENS, GW_RETRIES, GW_QUARANTINED,
    GW_REQUEST_DURATION, GW_TIME_TO_FIRST_TOKEN, GW_HIT_RATE, GW_TREE_CORRECTIONS,
    GW_UPSTREAM_TIMEOUTS, GW_WAIT_QUEUE, GW_WAIT_QUEUE_OUTCOMES, GW_WAIT_QUEUE_SECONDS,
)

ALL_METRICS: tuple[MetricSpec, ...] = WORKER_METRICS + GATEWAY_METRICS
