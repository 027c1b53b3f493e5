"""The gateway's Prometheus metrics, named by the specs in `radixpool.protocol.metrics`.

The request path only bumps plain integers in dicts and bucket counts (a few hundred nanoseconds
in all); the Prometheus families are built from them, and from the worker set's live state
(in-flight, health, tree size, hit rates), when `/metrics` is scraped. That keeps the proxy's
per-request CPU inside its budget, which prometheus-client's locked per-child counters would not.

Worker churn: every rollout brings workers under new addresses (new pod IPs). A removed worker's
series stay until it has been gone, with nothing in flight, for `forget_after` seconds (the
gateway's `--removed-worker-series-seconds`), so the next scrapes still read its final values;
then they go, and so do its counters here. Added back before that, under the same address, it
carries on its series; after, they start again at 0 (a new series to Prometheus). Fleet-level
figures never lose removed workers' history: the fleet's hit rate (`worker="all"`) comes from
totals kept apart, and `sum(rate(...))` over the per-worker counters is unaffected by a series
ending (only a plain `sum(...)` of them, no `rate`, drops when one goes).

Pods: `radixpool_gateway_worker_info{worker, worker_pod}` names the pod behind each address that
has series, removed workers' included until their series go, so a dashboard's join on `worker`
keeps every line; a worker's pod name is remembered when it joins, leaves, and at each scrape.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

from radixpool.gateway.breaker import BREAKER_STATES
from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.prefix_index import PrefixIndex
from radixpool.gateway.workers import Worker, WorkerSet
from radixpool.protocol import metrics as spec

BUCKETS = spec.LATENCY_BUCKETS
# Label values of rare events, exported at 0 before the first: Prometheus' rate() needs a
# series' earlier sample, so one born at 1 would never show its first event on a dashboard.
SERVER_ERRORS = ("500", "502", "503", "504")   # by each worker, and by the gateway itself
# the client's: a bad body or too large a one (the gateway's own check, or the worker's), a model
# no worker serves, the client gone before its answer was whole
CLIENT_ERRORS = ("400", "404", "413", "499")
CORRECTION_SOURCES = ("cached_tokens", "instance_id", "kv_resync")
HOLD_OUTCOMES = ("placed", "overdue", "left", "rejected")


class _Histogram:
    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.total += value

    def family(self, s: spec.MetricSpec) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, count in zip((*map(str, BUCKETS), "+Inf"), self.counts):
            running += count
            cumulative.append((bound, running))
        return HistogramMetricFamily(s.name, s.help, buckets=cumulative, sum_value=self.total)


def _counter(s: spec.MetricSpec, samples: dict[tuple[str, ...], float]) -> CounterMetricFamily:
    family = CounterMetricFamily(s.name, s.help, labels=s.labels)
    for labels, value in samples.items():
        family.add_metric(labels, value)
    return family


@dataclass
class TokenTotals:
    """Prompt, cached and predicted-cached tokens answered, by every worker ever: the fleet's."""
    prompt: int = 0
    cached: int = 0
    predicted: int = 0


class GatewayMetrics:
    def __init__(self, forget_after: float = GatewayConfig.removed_worker_series_seconds
                 ) -> None:
        self.requests: dict[tuple[str, str], int] = defaultdict(int)
        self.decisions: dict[tuple[str, str], int] = defaultdict(int)
        self.prompt: dict[tuple[str], int] = defaultdict(int)
        self.cached: dict[tuple[str], int] = defaultdict(int)
        self.predicted: dict[tuple[str], int] = defaultdict(int)
        self.corrections: dict[tuple[str, str], int] = defaultdict(int)
        self.timeouts: dict[tuple[str], int] = defaultdict(int)
        self.retries = 0
        self.quarantined = 0
        self.holding = 0
        self.held_outcomes: dict[tuple[str], int] = defaultdict(int)
        self.hold = _Histogram()
        self.duration = _Histogram()
        self.ttft = _Histogram()
        self.fleet = TokenTotals()
        self.pods: dict[str, str] = {}   # worker address -> its worker_pod label
        self.forget_after = forget_after
        self._gone: dict[str, float] = {}   # worker address -> since when it has been gone
        self.registry = CollectorRegistry(auto_describe=False)
        self._state: tuple[WorkerSet, PrefixIndex, float] | None = None
        self.registry.register(self)

    # --- the request path ---------------------------------------------------------------------
    def decision(self, worker: str, reason: str) -> None:
        self.decisions[worker, reason] += 1

    def retry(self) -> None:
        self.retries += 1

    def answered(self, worker: str, code: int, duration: float, ttfb: float | None) -> None:
        self.requests[worker, str(code)] += 1
        self.duration.observe(duration)
        if ttfb is not None:
            self.ttft.observe(ttfb)

    def usage(self, worker: str, prompt: int, cached: int, predicted: int | None) -> None:
        self.prompt[worker,] += prompt
        self.cached[worker,] += cached
        self.fleet.prompt += prompt
        self.fleet.cached += cached
        if predicted is not None:
            self.predicted[worker,] += predicted
            self.fleet.predicted += predicted

    def corrected(self, worker: str, source: str) -> None:
        self.corrections[worker, source] += 1

    def upstream_timeout(self, worker: str) -> None:
        self.timeouts[worker,] += 1

    def held(self, outcome: str, seconds: float) -> None:
        self.held_outcomes[outcome,] += 1
        self.hold.observe(seconds)

    # --- workers come and gone ----------------------------------------------------------------
    def named(self, worker: Worker) -> None:
        """Remember `worker`'s pod: its series keep that name after it leaves, until they go."""
        self.pods[worker.url] = worker.pod_label

    def forget_gone(self, workers: WorkerSet, now: float) -> None:
        """Drop the counters of workers gone for `forget_after` seconds: neither in the fleet
        nor finishing requests there. A scan of the per-worker counters: run at a scrape (which
        reads them all anyway) and after membership changes, not per request."""
        counts = self._per_worker
        live = {"gateway", *(w.url for w in workers), *(w.url for w in workers.departed)}
        seen = {key[0] for c in counts for key in c} | set(self.pods)
        gone = self._gone
        for url in seen - live:
            gone.setdefault(url, now)
        for url in [u for u in gone if u in live]:
            del gone[url]
        expired = {url for url, since in gone.items() if now - since >= self.forget_after}
        if not expired:
            return
        for c in counts:
            for key in [k for k in c if k[0] in expired]:
                del c[key]
        for url in expired:
            del gone[url]
            self.pods.pop(url, None)

    @property
    def _per_worker(self) -> tuple[dict, ...]:
        """The counters whose first label is a worker."""
        return (self.requests, self.decisions, self.prompt, self.cached, self.predicted,
                self.corrections, self.timeouts)

    # --- the scrape ---------------------------------------------------------------------------
    def render(self, workers: WorkerSet, index: PrefixIndex, now: float) -> bytes:
        for worker in (*workers, *workers.departed):   # a pod name may change (address reused)
            self.named(worker)
        self.forget_gone(workers, now)
        self._state = (workers, index, now)
        return generate_latest(self.registry)

    def collect(self):
        live = () if self._state is None else [w.url for w in self._state[0]]
        yield _counter(spec.GW_REQUESTS, {
            **{(url, code): 0 for url in ("gateway", *live)
               for code in (*SERVER_ERRORS, *CLIENT_ERRORS)},
            **self.requests})
        yield _counter(spec.GW_ROUTE_DECISIONS, {**{(url, "retry"): 0 for url in live},
                                                 **self.decisions})
        yield _counter(spec.GW_PROMPT_TOKENS, self.prompt)
        yield _counter(spec.GW_CACHED_TOKENS, self.cached)
        yield _counter(spec.GW_PREDICTED_CACHED_TOKENS, self.predicted)
        yield _counter(spec.GW_TREE_CORRECTIONS, {
            **{(url, source): 0 for url in live for source in CORRECTION_SOURCES},
            **self.corrections})
        yield _counter(spec.GW_UPSTREAM_TIMEOUTS, {**{(url,): 0 for url in live},
                                                   **self.timeouts})
        info = InfoMetricFamily(spec.GW_WORKER_INFO.name, spec.GW_WORKER_INFO.help)
        for url, pod in self.pods.items():
            info.add_metric(spec.GW_WORKER_INFO.labels, {"worker": url, "worker_pod": pod})
        yield info
        yield _counter(spec.GW_RETRIES, {(): self.retries})
        yield _counter(spec.GW_QUARANTINED, {(): self.quarantined})
        yield self.duration.family(spec.GW_REQUEST_DURATION)
        yield self.ttft.family(spec.GW_TIME_TO_FIRST_TOKEN)
        yield GaugeMetricFamily(spec.GW_WAIT_QUEUE.name, spec.GW_WAIT_QUEUE.help,
                                value=self.holding)
        yield _counter(spec.GW_WAIT_QUEUE_OUTCOMES, {
            **{(outcome,): 0 for outcome in HOLD_OUTCOMES}, **self.held_outcomes})
        yield self.hold.family(spec.GW_WAIT_QUEUE_SECONDS)
        if self._state is None:
            return
        workers, index, now = self._state
        keys = workers.keys
        unit = keys.block_size if keys.tokenizer is not None else keys.text_block_bytes
        inflight = GaugeMetricFamily(spec.GW_INFLIGHT.name, spec.GW_INFLIGHT.help,
                                     labels=spec.GW_INFLIGHT.labels)
        healthy = GaugeMetricFamily(spec.GW_WORKER_HEALTHY.name, spec.GW_WORKER_HEALTHY.help,
                                    labels=spec.GW_WORKER_HEALTHY.labels)
        breakers = GaugeMetricFamily(spec.GW_BREAKER_STATE.name, spec.GW_BREAKER_STATE.help,
                                     labels=spec.GW_BREAKER_STATE.labels)
        tree = GaugeMetricFamily(spec.GW_TREE_TOKENS.name, spec.GW_TREE_TOKENS.help,
                                 labels=spec.GW_TREE_TOKENS.labels)
        rates = GaugeMetricFamily(spec.GW_HIT_RATE.name, spec.GW_HIT_RATE.help,
                                  labels=spec.GW_HIT_RATE.labels)
        # hit rates come from the token counters (by address, since start), not from the
        # `Worker` objects: a worker removed and added back starts a new object; the fleet's
        # from its own totals, which keep what removed workers answered after their series go
        prompt, cached, predicted = self.prompt, self.cached, self.predicted
        for w in workers:
            inflight.add_metric((w.url,), w.inflight)
            healthy.add_metric((w.url,), 1 if w.health.healthy and not w.draining
                               and not w.terminating else 0)
            tree.add_metric((w.url,), index.size(w.url) * unit)
            state = w.breaker.state(now)
            for each in BREAKER_STATES:
                breakers.add_metric((w.url, each), 1 if each == state else 0)
            url = (w.url,)
            _rates(rates, w.url, prompt.get(url, 0), cached.get(url, 0), predicted.get(url, 0))
        for w in workers.departed:   # removed, its requests still streaming through us
            inflight.add_metric((w.url,), w.inflight)
        fleet = self.fleet
        _rates(rates, "all", fleet.prompt, fleet.cached, fleet.predicted)
        yield from (inflight, healthy, breakers, tree, rates)


def _rates(family: GaugeMetricFamily, worker: str, prompt: int, cached: int,
           predicted: int) -> None:
    family.add_metric((worker, "actual"), cached / prompt if prompt else 0.0)
    family.add_metric((worker, "predicted"), predicted / prompt if prompt else 0.0)
