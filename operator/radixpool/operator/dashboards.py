"""Grafana dashboards, built from the metric specs so they query only what the code exports.

`python -m radixpool.operator.dashboards` writes `dashboards/*.json` and the chart's copies
(`charts/radixpool/dashboards/`); a test fails when they are stale or when any query names a
series that `radixpool.protocol.metrics` does not define. Series carry the labels the
ServiceMonitor adds: `namespace`, `pod`, `radixpool_io_pool` (the pool) and
`app_kubernetes_io_component`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from radixpool.protocol import metrics as m

from .generated import repo_root_argument, write_copies

POOL = 'namespace=~"$namespace", radixpool_io_pool=~"$pool"'
WORKER = f'{POOL}, pod=~"$pod"'
SERVER_ERRORS = f'{POOL}, code=~"5.."'
CLIENT_ERRORS = f'{POOL}, code=~"4.."'   # 499 (the client left) among them
RATE = "[$__rate_interval]"
DASHBOARD_DIRS = ("dashboards", "charts/radixpool/dashboards")


def _rate(metric: str, selector: str) -> str:
    return f"rate({metric}{{{selector}}}{RATE})"


def _quantiles(histogram: m.MetricSpec, selector: str, by: str = "") -> list[dict[str, str]]:
    group = f"le{', ' + by if by else ''}"
    return [{"expr": f"histogram_quantile({q}, sum by ({group}) "
                     f"({_rate(histogram.name + '_bucket', selector)}))",
             "legendFormat": f"p{int(q * 100)}{' {{' + by + '}}' if by else ''}"}
            for q in (0.5, 0.9, 0.99)]


def _with_pods(per_worker: str) -> str:
    """A query with one series per worker address, each given its pod's name (`worker_pod`,
    the `pod` of the worker's own series) from the gateway's info series. Every gateway replica
    exports one per worker, and for a moment after an address is reused by a new pod two
    replicas may name different pods: `topk by (worker) (1, ...)` keeps one per worker, so no
    line is doubled and the join never fails on duplicates."""
    return (f"{per_worker} * on (worker) group_left (worker_pod) "
            f"topk by (worker) (1, {m.GW_WORKER_INFO.series[0]}{{{POOL}}})")


def _thresholds(*steps: tuple[str, float | None]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": color, "value": value}
                                          for color, value in steps]}


# A stat panel left without thresholds gets Grafana's default (green, red from 80): a worker
# that fails its health checks (0) showed green, and a pool of 80 workers or more showed red.
HEALTHY = _thresholds(("red", None), ("green", 1))
NEUTRAL = _thresholds(("text", None))


def _kv_held_by_requests(selector: str) -> str:
    """Share of KV slots running requests hold: the usage ratio counts the radix cache too,
    which fills a warm worker's pool and is evicted on demand."""
    return (f"{m.KV_CACHE_USAGE.name}{{{selector}}} - {m.KV_CACHE_EVICTABLE.name}{{{selector}}}"
            f" / {m.KV_CACHE_CAPACITY.name}{{{selector}}}")


def _panel(title: str, targets: list[dict[str, str]], unit: str, description: str,
           kind: str = "timeseries", thresholds: dict[str, Any] | None = None
           ) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit}
    if unit == "percentunit":   # ratios are 0-1: a fixed axis keeps 40% from looking like 100%
        defaults |= {"min": 0, "max": 1}
    if thresholds is not None:
        defaults["thresholds"] = thresholds
    return {
        "type": kind, "title": title, "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "targets": [{**target, "refId": chr(ord("A") + i),
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, target in enumerate(targets)],
    }


def _variables(per_worker: bool) -> list[dict[str, Any]]:
    def query(name: str, expr: str, label: str) -> dict[str, Any]:
        return {"name": name, "label": label, "type": "query", "refresh": 2,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": {"query": expr, "refId": name}, "definition": expr,
                "includeAll": True, "multi": True, "allValue": ".*",
                "current": {"text": "All", "value": "$__all"}}

    info = m.WORKER_INFO.series[0]
    variables = [
        {"name": "datasource", "label": "Data source", "type": "datasource",
         "query": "prometheus", "current": {}},
        query("namespace", f"label_values({info}, namespace)", "Namespace"),
        query("pool", f'label_values({info}{{namespace=~"$namespace"}}, radixpool_io_pool)',
              "Pool"),
    ]
    if per_worker:
        variables.append(query("pod", f"label_values({info}{{{POOL}}}, pod)", "Worker"))
    return variables


def _layout(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for index, panel in enumerate(panels):
        panel["id"] = index + 1
        panel["gridPos"] = {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)}
    return panels


def _dashboard(uid: str, title: str, description: str, panels: list[dict[str, Any]],
               per_worker: bool) -> dict[str, Any]:
    return {
        "uid": uid, "title": title, "description": description,
        "tags": ["radixpool", "llm"], "timezone": "browser", "schemaVersion": 39,
        "version": 1, "editable": True, "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": _variables(per_worker)},
        "annotations": {"list": []},
        "panels": _layout(panels),
    }


def fleet_dashboard() -> dict[str, Any]:
    gw_prompt = f"sum({_rate(m.GW_PROMPT_TOKENS.name, POOL)})"
    panels = [
        _panel("Requests finished / s", [
            {"expr": f"sum by (finish_reason) ({_rate(m.REQUESTS.name, POOL)})",
             "legendFormat": "{{finish_reason}}"}], "reqps", "Worker-side, by finish reason."),
        _panel("Gateway requests / s", [
            {"expr": f"sum by (code) ({_rate(m.GW_REQUESTS.name, POOL)})",
             "legendFormat": "{{code}}"},
            {"expr": f"sum({_rate(m.GW_RETRIES.name, POOL)})", "legendFormat": "retries"}],
            "reqps", "What clients see, by HTTP status; retries before the first byte."),
        _panel("Gateway errors / s", [
            {"expr": f"sum by (code) ({_rate(m.GW_REQUESTS.name, SERVER_ERRORS)})",
             "legendFormat": "{{code}}"},
            {"expr": f"sum({_rate(m.GW_REQUESTS.name, CLIENT_ERRORS)})",
             "legendFormat": "4xx and 499 (the client's)"}], "reqps",
            "Server errors by HTTP status (worker=\"gateway\" series are the gateway's own "
            "answers, e.g. 503 with no worker; a 200 stream that ended in an error event counts "
            "under the error's status, e.g. 500), and one line for the answers a client caused: "
            "bad requests, and clients that left (499), which chat traffic has plenty of."),
        _panel("Retries, quarantines and upstream timeouts / s", [
            {"expr": f"sum({_rate(m.GW_RETRIES.name, POOL)})", "legendFormat": "retried"},
            {"expr": f"sum({_rate(m.GW_QUARANTINED.name, POOL)})",
             "legendFormat": "quarantined (query of death)"},
            {"expr": _with_pods(
                f"sum by (worker) ({_rate(m.GW_UPSTREAM_TIMEOUTS.name, POOL)})"),
             "legendFormat": "upstream timeout {{worker_pod}}"}], "reqps",
            "Retries on another worker before the first byte; requests refused "
            "because two engines died holding them; requests cut at a worker's deadline."),
        _panel("Time to first token", [
            *_quantiles(m.TIME_TO_FIRST_TOKEN, POOL),
            {"expr": _quantiles(m.GW_TIME_TO_FIRST_TOKEN, POOL)[2]["expr"],
             "legendFormat": "p99 at the gateway"}], "s",
            "Engine view (every request) and gateway view (streamed requests)."),
        _panel("Inter-token latency", _quantiles(m.INTER_TOKEN_LATENCY, POOL), "s",
               "Time between generated tokens, streamed or not (tokens that come together "
               "share the gap)."),
        _panel("Request latency", [
            *_quantiles(m.E2E_REQUEST_LATENCY, POOL),
            {"expr": _quantiles(m.GW_REQUEST_DURATION, POOL)[2]["expr"],
             "legendFormat": "p99 at the gateway"}], "s", "Arrival to last token."),
        _panel("Queue time", _quantiles(m.QUEUE_TIME, POOL), "s", "Arrival to admission."),
        _panel("Throughput (tokens / s)", [
            {"expr": f"sum({_rate(m.PROMPT_TOKENS.name, POOL)})", "legendFormat": "prompt"},
            {"expr": f"sum({_rate(m.CACHED_PROMPT_TOKENS.name, POOL)})",
             "legendFormat": "prompt from cache"},
            {"expr": f"sum({_rate(m.GENERATION_TOKENS.name, POOL)})",
             "legendFormat": "generated"}], "short", "Tokens per second across the pool."),
        _panel("Cache hit rate: actual vs predicted", [
            {"expr": f"sum({_rate(m.GW_CACHED_TOKENS.name, POOL)}) / {gw_prompt}",
             "legendFormat": "actual (workers' cached_tokens)"},
            {"expr": f"sum({_rate(m.GW_PREDICTED_CACHED_TOKENS.name, POOL)}) / {gw_prompt}",
             "legendFormat": "predicted (gateway's trees)"}], "percentunit",
            "Cached / prompt tokens of the answered requests in the window (each request is "
            "counted by the one gateway replica it passed). The prediction counts whole "
            "routing blocks, so on a healthy fleet actual runs a little above it; predicted "
            "above actual means the gateway's trees promise prefixes the workers no longer "
            "hold (stale routing)."),
        _panel("Load per worker (running)", [
            {"expr": f"sum by (pod) ({m.NUM_REQUESTS_RUNNING.name}{{{POOL}}})",
             "legendFormat": "{{pod}}"}], "short", "Requests in each worker's running batch."),
        _panel("Queue per worker (waiting)", [
            {"expr": f"sum by (pod) ({m.NUM_REQUESTS_WAITING.name}{{{POOL}}})",
             "legendFormat": "{{pod}}"}], "short", "Requests waiting for admission."),
        _panel("KV held by requests per worker", [
            {"expr": f"max by (pod) ({_kv_held_by_requests(POOL)})",
             "legendFormat": "{{pod}}"}], "percentunit",
            "Share of KV slots running requests hold: what runs out (see retractions). The "
            "rest of a warm worker's pool is radix cache no request uses, evicted on demand."),
        _panel("Retractions / s", [
            {"expr": f"sum by (pod) ({_rate(m.RETRACTED_REQUESTS.name, POOL)})",
             "legendFormat": "{{pod}}"}], "reqps",
            "Running requests pushed back to the queue because KV memory ran out."),
        _panel("Radix evictions (tokens / s)", [
            {"expr": f"sum by (pod) ({_rate(m.RADIX_EVICTED_TOKENS.name, POOL)})",
             "legendFormat": "{{pod}}"}], "short",
            "Tokens evicted from the radix cache to make room: cache pressure."),
        _panel("Routing decisions / s", [
            {"expr": f"sum by (reason) ({_rate(m.GW_ROUTE_DECISIONS.name, POOL)})",
             "legendFormat": "{{reason}}"}], "reqps", "Why the gateway picked each worker."),
        _panel("Routing tree corrections / s", [
            {"expr": f"sum by (source) ({_rate(m.GW_TREE_CORRECTIONS.name, POOL)})",
             "legendFormat": "{{source}}"}], "ops",
            "Times the gateway fixed a worker's prefix tree from ground truth (cached_tokens, "
            "a new instance_id, a KV-event resync): frequent ones mean stale routing."),
        _panel("Routing tree size per worker (gateway)", [
            {"expr": _with_pods(f"max by (worker) ({m.GW_TREE_TOKENS.name}{{{POOL}}})"),
             "legendFormat": "{{worker_pod}}"}], "short",
            "Tokens (prompt bytes, for a gateway without a tokenizer) the gateway's prefix tree "
            "holds for each worker, largest over gateway replicas: compare with the worker's "
            "radix cache on the worker board."),
        _panel("In flight per worker (gateway)", [
            {"expr": _with_pods(f"sum by (worker) ({m.GW_INFLIGHT.name}{{{POOL}}})"),
             "legendFormat": "{{worker_pod}}"}], "short", "The gateway's view of worker load."),
        _panel("Gateway wait queue (late binding)", [
            {"expr": f"sum({m.GW_WAIT_QUEUE.name}{{{POOL}}})", "legendFormat": "held now"}],
            "short", "Requests the gateways hold while their worker has prefill queued."),
        _panel("Wait queue outcomes / s", [
            {"expr": f"sum by (outcome) ({_rate(m.GW_WAIT_QUEUE_OUTCOMES.name, POOL)})",
             "legendFormat": "{{outcome}}"}], "reqps",
            "How held requests leave: placed, overdue (sent at the deadline), left (client "
            "gone), rejected (503)."),
        _panel("Time held in the gateway", _quantiles(m.GW_WAIT_QUEUE_SECONDS, POOL), "s",
               "Arrival at the gateway to being sent to a worker, for held requests."),
        _panel("Worker health", [
            {"expr": _with_pods(f"min by (worker) ({m.GW_WORKER_HEALTHY.name}{{{POOL}}})"),
             "legendFormat": "{{worker_pod}}"}], "bool_yes_no",
            "1: the gateway sends this worker traffic.", kind="stat", thresholds=HEALTHY),
        _panel("Circuit breakers not closed", [
            # Each gateway replica has its own breakers: a worker shows if any replica's is.
            {"expr": _with_pods(f'(max by (worker, state) ({m.GW_BREAKER_STATE.name}{{{POOL}, '
                                f'state!="closed"}}) > 0)'),
             "legendFormat": "{{state}} {{worker_pod}}"}], "short",
            "Workers some gateway sends no traffic (open) or one probe at a time (half_open), "
            "after consecutive failed requests; empty when every breaker is closed."),
        _panel("Workers up", [
            {"expr": f"count({m.WORKER_INFO.series[0]}{{{POOL}}})", "legendFormat": "workers"},
            # Every gateway replica reports every worker: one per worker, healthy if any
            # gateway routes to it, so more gateway replicas never count a worker twice.
            {"expr": f"sum(max by (worker) ({m.GW_WORKER_HEALTHY.name}{{{POOL}}}))",
             "legendFormat": "healthy (gateway)"}], "short",
            "Workers exporting metrics vs workers the gateway routes to.", kind="stat",
            thresholds=NEUTRAL),
    ]
    return _dashboard("radixpool-fleet", "RadixPool / Fleet",
                      "Every pool's traffic, latency, cache effectiveness and worker health.",
                      panels, per_worker=False)


def worker_dashboard() -> dict[str, Any]:
    panels = [
        _panel("Time to first token", _quantiles(m.TIME_TO_FIRST_TOKEN, WORKER, "pod"), "s",
               "Per worker."),
        _panel("Inter-token latency", _quantiles(m.INTER_TOKEN_LATENCY, WORKER, "pod"), "s",
               "Per worker."),
        _panel("Request latency", _quantiles(m.E2E_REQUEST_LATENCY, WORKER, "pod"), "s",
               "Per worker."),
        _panel("Queue time", _quantiles(m.QUEUE_TIME, WORKER, "pod"), "s", "Per worker."),
        _panel("Running and waiting", [
            {"expr": f"sum by (pod) ({m.NUM_REQUESTS_RUNNING.name}{{{WORKER}}})",
             "legendFormat": "running {{pod}}"},
            {"expr": f"sum by (pod) ({m.NUM_REQUESTS_WAITING.name}{{{WORKER}}})",
             "legendFormat": "waiting {{pod}}"}], "short", "The worker's queue."),
        _panel("KV cache", [
            {"expr": f"max by (pod) ({m.KV_CACHE_USAGE.name}{{{WORKER}}})",
             "legendFormat": "in use {{pod}}"},
            {"expr": f"max by (pod) ({_kv_held_by_requests(WORKER)})",
             "legendFormat": "held by requests {{pod}}"}], "percentunit",
            "Share of KV slots in use (running requests and radix cache), and held by running "
            "requests: the gap is cache no request uses, evicted on demand."),
        _panel("Radix cache size (tokens)", [
            {"expr": f"max by (pod) ({m.RADIX_CACHE_TOKENS.name}{{{WORKER}}})",
             "legendFormat": "cached {{pod}}"},
            {"expr": f"max by (pod) ({m.KV_CACHE_CAPACITY.name}{{{WORKER}}})",
             "legendFormat": "capacity {{pod}}"}], "short", "Tokens held vs KV capacity."),
        # Over the board's window, not radixpool_cache_hit_rate (the last 1000 requests,
        # however old): an idle worker would show the rate of an hour ago as current.
        _panel("Cache hit rate", [
            {"expr": f"sum by (pod) ({_rate(m.CACHED_PROMPT_TOKENS.name, WORKER)}) / "
                     f"sum by (pod) ({_rate(m.PROMPT_TOKENS.name, WORKER)})",
             "legendFormat": "{{pod}}"}], "percentunit",
            "Cached / prompt tokens of the requests each worker finished in the window; "
            "empty while it finishes none."),
        _panel("Tokens / s", [
            {"expr": f"sum by (pod) ({_rate(m.PROMPT_TOKENS.name, WORKER)})",
             "legendFormat": "prompt {{pod}}"},
            {"expr": f"sum by (pod) ({_rate(m.CACHED_PROMPT_TOKENS.name, WORKER)})",
             "legendFormat": "cached {{pod}}"},
            {"expr": f"sum by (pod) ({_rate(m.GENERATION_TOKENS.name, WORKER)})",
             "legendFormat": "generated {{pod}}"}], "short", "Per worker throughput."),
        _panel("Retractions / s", [
            {"expr": f"sum by (pod) ({_rate(m.RETRACTED_REQUESTS.name, WORKER)})",
             "legendFormat": "{{pod}}"}], "reqps", "KV pressure: running requests requeued."),
        _panel("Radix evictions (tokens / s)", [
            {"expr": f"sum by (pod) ({_rate(m.RADIX_EVICTED_TOKENS.name, WORKER)})",
             "legendFormat": "{{pod}}"}], "short", "Cache pressure: tokens evicted."),
        _panel("KV double frees / s", [
            {"expr": f"sum by (pod) ({_rate(m.KV_DOUBLE_FREES.name, WORKER)})",
             "legendFormat": "{{pod}}"}], "ops",
            "KV pages freed while already free: an engine bug (counted and ignored). "
            "Anything above zero deserves a bug report."),
        _panel("Non-finite logits (requests / s)", [
            {"expr": f"sum by (pod) ({_rate(m.NONFINITE_LOGITS.name, WORKER)})",
             "legendFormat": "{{pod}}"}], "reqps",
            "Requests ended with 500 nonfinite_logits: the model gave NaN or infinite logits "
            "for their prompt (fp16 overflow, a bad checkpoint, a kernel bug). The gateway's "
            "breaker leaves them out."),
        _panel("Model broken (non-finite)", [
            {"expr": f"max by (pod) ({m.NONFINITE_BROKEN.name}{{{WORKER}}})",
             "legendFormat": "{{pod}}"}], "short",
            "1: a run of non-finite requests and the worker's own self-check all gave NaN or "
            "infinite logits; its /health and /livez answer 503 until the kubelet restarts it."),
        _panel("Grammar compile time", _quantiles(m.GRAMMAR_COMPILE_SECONDS, WORKER, "pod"), "s",
               "Structured output (JSON schema, regex, EBNF): time to compile a constraint "
               "the grammar cache did not hold; the request waits for it."),
        _panel("Constrained requests / s", [
            {"expr": f"sum by (pod) ({_rate(m.GRAMMAR_COMPILE_SECONDS.name + '_count', WORKER)})",
             "legendFormat": "compiled {{pod}}"},
            {"expr": f"sum by (pod) ({_rate(m.GRAMMAR_CACHE_HITS.name, WORKER)})",
             "legendFormat": "grammar cache hit {{pod}}"}], "ops",
            "Structured-output requests whose grammar was compiled vs found in the cache."),
        _panel("Finished requests / s", [
            {"expr": f"sum by (pod, finish_reason) ({_rate(m.REQUESTS.name, WORKER)})",
             "legendFormat": "{{finish_reason}} {{pod}}"}], "reqps", "By finish reason."),
        _panel("Worker identity", [
            {"expr": f"max by (pod, model, version, instance_id) "
                     f"({m.WORKER_INFO.series[0]}{{{WORKER}}})",
             "legendFormat": "{{pod}} {{model}} {{version}} {{instance_id}}",
             "format": "table", "instant": True}], "short",
            "Model, version and instance id (changes on restart or cache flush).",
            kind="table"),
    ]
    return _dashboard("radixpool-worker", "RadixPool / Worker",
                      "One worker's latency, queue, KV and radix cache.", panels,
                      per_worker=True)


def dashboard_files() -> dict[str, str]:
    return {name: json.dumps(board, indent=2) + "\n" for name, board in (
        ("radixpool-fleet.json", fleet_dashboard()),
        ("radixpool-worker.json", worker_dashboard()))}


def write_dashboard_files(repo_root: Path) -> list[Path]:
    return write_copies(repo_root, DASHBOARD_DIRS, dashboard_files())


if __name__ == "__main__":
    for path in write_dashboard_files(repo_root_argument("the Grafana dashboards")):
        print(path)
