"""The gateway's Prometheus collectors, built from the specs in `radixpool.protocol.metrics`.

Counters and histograms are updated on the request path through cached label children (no label
lookup per request); gauges that describe state (in-flight, health, tree size, hit rates) are
refreshed from the worker set when `/metrics` is scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from radixpool.gateway.prefix_index import PrefixIndex
from radixpool.gateway.workers import WorkerSet
from radixpool.protocol import metrics as spec

_KINDS = {"counter": Counter, "gauge": Gauge}


def _build(s: spec.MetricSpec, registry: CollectorRegistry) -> MetricWrapperBase:
    name = s.name.removesuffix("_total") if s.kind == "counter" else s.name
    if s.kind == "histogram":
        return Histogram(name, s.help, s.labels, registry=registry, buckets=spec.LATENCY_BUCKETS)
    return _KINDS[s.kind](name, s.help, s.labels, registry=registry)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        m = {s.name: _build(s, self.registry) for s in spec.GATEWAY_METRICS}
        self._requests = m[spec.GW_REQUESTS.name]
        self._decisions = m[spec.GW_ROUTE_DECISIONS.name]
        self._inflight = m[spec.GW_INFLIGHT.name]
        self._healthy = m[spec.GW_WORKER_HEALTHY.name]
        self._prompt = m[spec.GW_PROMPT_TOKENS.name]
        self._cached = m[spec.GW_CACHED_TOKENS.name]
        self._predicted = m[spec.GW_PREDICTED_CACHED_TOKENS.name]
        self._tree = m[spec.GW_TREE_TOKENS.name]
        self._retries = m[spec.GW_RETRIES.name]
        self._duration = m[spec.GW_REQUEST_DURATION.name]
        self._ttft = m[spec.GW_TIME_TO_FIRST_TOKEN.name]
        self._hit_rate = m[spec.GW_HIT_RATE.name]
        self._corrections = m[spec.GW_TREE_CORRECTIONS.name]
        self._children: dict[tuple, object] = {}
        self._gauge_workers: set[str] = set()

    def _child(self, metric: MetricWrapperBase, *labels: str):
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def decision(self, worker: str, reason: str) -> None:
        self._child(self._decisions, worker, reason).inc()

    def retry(self) -> None:
        self._retries.inc()

    def answered(self, worker: str, code: int, duration: float, ttfb: float | None) -> None:
        self._child(self._requests, worker, str(code)).inc()
        self._duration.observe(duration)
        if ttfb is not None:
            self._ttft.observe(ttfb)

    def usage(self, worker: str, prompt: int, cached: int, predicted: int | None) -> None:
        self._child(self._prompt, worker).inc(prompt)
        self._child(self._cached, worker).inc(cached)
        if predicted is not None:
            self._child(self._predicted, worker).inc(predicted)

    def corrected(self, worker: str, source: str) -> None:
        self._child(self._corrections, worker, source).inc()

    def render(self, workers: WorkerSet, index: PrefixIndex) -> bytes:
        current = {w.url for w in workers}
        for gone in self._gauge_workers - current:
            for gauge in (self._inflight, self._healthy, self._tree):
                gauge.remove(gone)
            for kind in ("actual", "predicted"):
                self._hit_rate.remove(gone, kind)
        self._gauge_workers = current
        keys = workers.keys
        unit = keys.block_size if keys.tokenizer is not None else keys.text_block_bytes
        totals = [0, 0, 0]
        for w in workers:
            self._inflight.labels(w.url).set(w.inflight)
            self._healthy.labels(w.url).set(1 if w.health.healthy and not w.draining else 0)
            self._tree.labels(w.url).set(index.size(w.url) * unit)
            self._set_rates(w.url, w.prompt_tokens, w.cached_tokens, w.predicted_tokens)
            totals[0] += w.prompt_tokens
            totals[1] += w.cached_tokens
            totals[2] += w.predicted_tokens
        self._set_rates("all", *totals)
        return generate_latest(self.registry)

    def _set_rates(self, worker: str, prompt: int, cached: int, predicted: int) -> None:
        self._hit_rate.labels(worker, "actual").set(cached / prompt if prompt else 0.0)
        self._hit_rate.labels(worker, "predicted").set(predicted / prompt if prompt else 0.0)

