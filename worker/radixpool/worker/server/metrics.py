"""Prometheus metrics of one worker, built from the specs in `radixpool.protocol.metrics`.

Two sources, one registry per server:
- per-request series (tokens, finished requests, latencies, hit rate) are recorded by the server
  as each request finishes (`WorkerMetrics.record_*`);
- engine state (queue sizes, KV usage, radix size, retractions, evictions, KV double frees)
  and the info metric are read from the engine's latest stats at scrape time by
  `EngineCollector`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector

from radixpool.protocol import metrics as spec
from radixpool.protocol.metrics import GRAMMAR_COMPILE_BUCKETS, LATENCY_BUCKETS, MetricSpec

HIT_RATE_WINDOW = 1000   # finished requests in the `radixpool_cache_hit_rate` window
# Exported at 0 from the start: rate() needs a series' earlier sample, so one born at 1 (the
# first abort) would never show on a dashboard.
FINISH_REASONS = ("stop", "length", "abort")


def _counter(s: MetricSpec, registry: CollectorRegistry) -> Counter:
    assert s.kind == "counter"
    return Counter(s.name, s.help, s.labels, registry=registry)


def _histogram(s: MetricSpec, registry: CollectorRegistry) -> Histogram:
    assert s.kind == "histogram"
    return Histogram(s.name, s.help, s.labels, buckets=LATENCY_BUCKETS, registry=registry)


class HitRateWindow:
    """Cached / prompt tokens over the last `size` finished requests."""

    def __init__(self, size: int = HIT_RATE_WINDOW) -> None:
        self._items: deque[tuple[int, int]] = deque(maxlen=size)
        self._prompt = 0
        self._cached = 0

    def add(self, prompt_tokens: int, cached_tokens: int) -> None:
        if len(self._items) == self._items.maxlen:
            old_prompt, old_cached = self._items[0]
            self._prompt -= old_prompt
            self._cached -= old_cached
        self._items.append((prompt_tokens, cached_tokens))
        self._prompt += prompt_tokens
        self._cached += cached_tokens

    @property
    def rate(self) -> float:
        return self._cached / self._prompt if self._prompt else 0.0


class EngineCollector(Collector):
    """Engine gauges and counters, read at scrape time."""

    def __init__(self, engine_fn: Callable[[], Any], stats_fn: Callable[[], Any], model: str,
                 version: str, hit_rate: HitRateWindow) -> None:
        self.engine_fn = engine_fn
        self.stats_fn = stats_fn
        self.model = model
        self.version = version
        self.hit_rate = hit_rate

    def describe(self) -> Iterator:
        return iter(())

    def collect(self) -> Iterator:
        hit = GaugeMetricFamily(spec.CACHE_HIT_RATE.name, spec.CACHE_HIT_RATE.help)
        hit.add_metric([], self.hit_rate.rate)
        yield hit
        engine = self.engine_fn()
        if engine is None:
            return
        info = InfoMetricFamily(spec.WORKER_INFO.name, spec.WORKER_INFO.help)
        info.add_metric([], {"model": self.model, "version": self.version,
                             "instance_id": engine.instance_id})
        yield info
        stats = self.stats_fn()
        if stats is None:
            return
        capacity = stats.kv_capacity_tokens
        for s, value in (
            (spec.NUM_REQUESTS_RUNNING, stats.running),
            (spec.NUM_REQUESTS_WAITING, stats.waiting),
            (spec.KV_CACHE_USAGE, stats.kv_used_tokens / capacity if capacity else 0.0),
            (spec.KV_CACHE_CAPACITY, capacity),
            (spec.RADIX_CACHE_TOKENS, stats.radix_cache_tokens),
            (spec.KV_CACHE_EVICTABLE, stats.evictable_tokens),
        ):
            family = GaugeMetricFamily(s.name, s.help)
            family.add_metric([], value)
            yield family
        for s, value in ((spec.RETRACTED_REQUESTS, stats.retracted_total),
                         (spec.RADIX_EVICTED_TOKENS, stats.evicted_tokens_total),
                         (spec.KV_DOUBLE_FREES, stats.kv_double_frees_total),
                         (spec.NONFINITE_LOGITS, stats.nonfinite_logits_total),
                         (spec.GRAMMAR_CACHE_HITS, stats.grammar_cache_hits_total)):
            family = CounterMetricFamily(s.name, s.help)
            family.add_metric([], value)
            yield family
        yield grammar_compile_histogram(stats)


def grammar_compile_histogram(stats: Any) -> HistogramMetricFamily:
    """The engine core's compile-time histogram (cumulative bucket counts in its stats)."""
    s = spec.GRAMMAR_COMPILE_SECONDS
    counts = stats.grammar_compile_buckets or (0,) * (len(GRAMMAR_COMPILE_BUCKETS) + 1)
    bounds = [str(b) for b in GRAMMAR_COMPILE_BUCKETS] + ["+Inf"]
    family = HistogramMetricFamily(s.name, s.help)
    family.add_metric([], list(zip(bounds, counts)), stats.grammar_compile_seconds_sum)
    return family


class WorkerMetrics:
    def __init__(self, model: str, version: str, engine_fn: Callable[[], Any],
                 stats_fn: Callable[[], Any], broken_fn: Callable[[], bool] = lambda: False
                 ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.prompt_tokens = _counter(spec.PROMPT_TOKENS, r)
        self.cached_tokens = _counter(spec.CACHED_PROMPT_TOKENS, r)
        self.generation_tokens = _counter(spec.GENERATION_TOKENS, r)
        self.requests = _counter(spec.REQUESTS, r)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self.ttft = _histogram(spec.TIME_TO_FIRST_TOKEN, r)
        self.itl = _histogram(spec.INTER_TOKEN_LATENCY, r)
        self.e2e = _histogram(spec.E2E_REQUEST_LATENCY, r)
        self.queue_time = _histogram(spec.QUEUE_TIME, r)
        self.hit_rate = HitRateWindow()
        broken = Gauge(spec.NONFINITE_BROKEN.name, spec.NONFINITE_BROKEN.help, registry=r)
        broken.set_function(lambda: float(broken_fn()))
        r.register(EngineCollector(engine_fn, stats_fn, model, version, self.hit_rate))
        ProcessCollector(registry=r)   # process_cpu_seconds_total etc. of the HTTP front end

    def record_first_token(self, ttft_s: float, queue_time_s: float | None) -> None:
        self.ttft.observe(max(ttft_s, 0.0))
        if queue_time_s is not None:
            self.queue_time.observe(max(queue_time_s, 0.0))

    def record_token_gap(self, seconds: float, tokens: int = 1) -> None:
        """`tokens` tokens each `seconds` after the one before (one observation per token)."""
        for _ in range(tokens):
            self.itl.observe(max(seconds, 0.0))

    def record_finished(self, finish_reason: str | None, prompt_tokens: int, cached_tokens: int,
                        completion_tokens: int, e2e_s: float) -> None:
        self.requests.labels(finish_reason or "unknown").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(max(e2e_s, 0.0))
        self.hit_rate.add(prompt_tokens, cached_tokens)

    def record_aborted(self, e2e_s: float, prompt_tokens: int = 0, cached_tokens: int = 0,
                       completion_tokens: int = 0) -> None:
        """A request closed before the engine finished it (the client left), with the tokens it
        had been through: its prompt once its first token came, and what it generated."""
        self.requests.labels("abort").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(max(e2e_s, 0.0))
        if prompt_tokens:
            self.hit_rate.add(prompt_tokens, cached_tokens)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

