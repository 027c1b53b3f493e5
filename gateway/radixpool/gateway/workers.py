"""The fleet as the gateway sees it: one `Worker` per upstream, and the `WorkerSet` that adds,
drains and removes them (from the admin API or discovery), tells the membership hooks (the health
monitor, the proxy's connection pools), and keeps the prefix index's membership and capacities in
step. The admin API and the monitor reach the gateway's state only through a `WorkerSet`.

A worker is *eligible* for a new request when its active checks say healthy, it is not draining
(it answered 503) or terminating (discovery says so), it has not been removed,
and its circuit breaker lets traffic through. Removal or draining never touches requests already
in flight: their connections and this object live until their streams end; a worker added back
meanwhile is that same object again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from radixpool.gateway.breaker import CircuitBreaker
from radixpool.gateway.config import GatewayConfig, normalize_worker_url
from radixpool.gateway.health import HealthHysteresis
from radixpool.gateway.policies import Candidate
from radixpool.gateway.prefix_index import PrefixIndex
from radixpool.gateway.route_key import BYTES_PER_TOKEN, KeyBuilder, RouteKey
from radixpool.protocol.server_info import ServerInfo

UNCACHED_SMOOTHING = 0.2


@dataclass(eq=False)
class Worker:
    url: str
    health: HealthHysteresis
    breaker: CircuitBreaker
    pod: str | None = None      # its pod's name, where discovery's endpoint names it
    host: str = ""
    port: int = 0
    inflight: int = 0
    inflight_sequences: int = 0   # the same requests' sequences (each choice of each prompt)
    draining: bool = False      # the worker said so (503 from /health or a request)
    # why its last /health check failed: {"status": 503 or None (no answer), "code": the error
    # code its body gave, e.g. "nonfinite_logits"}; None once it answers 200
    health_failure: dict | None = None
    terminating: bool = False   # discovery said so (a terminating endpoint)
    removed: bool = False
    info: ServerInfo | None = None
    instance_id: str | None = None
    requests: int = 0
    answered_at: float = 0.0            # when it last answered a request in full (clock time)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_tokens: int = 0
    mean_uncached: float | None = None  # recent uncached prompt tokens per request (average)
    corrections: dict[str, int] = field(default_factory=dict)
    reports_cached: bool | None = None  # whether its last answer said how much was cached
    unreported_answers: int = 0         # answers without cached_tokens (left out of hit rates)
    kv_events_live: bool = False        # the monitor is following its KV-event stream
    # requests it holds, as its KV-event stream last said (None: not said, or not followed),
    # and how many of them were not this gateway's then (other gateways' requests)
    reported_load: int | None = None
    others_load: int = 0
    # Requests sent here whose prefill has not ended, by the hash of their prompt's last whole
    # block: the uncached tokens the gateway expected each to compute. A worker caches a prompt
    # the moment its prefill ends, so the KV event storing that block ends the wait.
    awaiting_prefill: dict[int, list[float]] = field(default_factory=dict)
    info_path: str = "/server_info"     # where it describes itself (SGLang: /get_server_info)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        self.host, self.port = parts.hostname or "", parts.port or 80

    @property
    def pod_label(self) -> str:
        """Its `worker_pod` label: the pod's name, else (a static worker, no Kubernetes) its
        host:port, so per-pod panels still show it."""
        return self.pod or urlsplit(self.url).netloc

    def eligible(self, now: float) -> bool:
        return (self.health.healthy and not self.draining and not self.terminating
                and not self.removed and self.breaker.allows(now))

    @property
    def model(self) -> str | None:
        return None if self.info is None else self.info.served_model_name

    @property
    def tree_source(self) -> str:
        """What keeps this worker's tree right besides routing history: its KV events, else the
        cached_tokens its answers report, else nothing but the tree's LRU bound."""
        if self.kv_events_live:
            return "kv_events"
        return "cached_tokens" if self.reports_cached else "lru"

    def observe_load(self, requests: int | None) -> None:
        """The worker's KV-event stream said it holds `requests` (None: it stopped saying)."""
        self.reported_load = requests
        self.others_load = 0 if requests is None else max(0, requests - self.inflight_sequences)

    @property
    def load(self) -> int:
        """Requests in flight there: this gateway's own, counted as they come and go, plus the
        others' as of the worker's last report (the sequences it holds less this gateway's then:
        another gateway's `n` > 1 request counts each choice, this gateway's count none). The
        report lags by up to ~10 ms, so it never replaces the fresher count of its own; with one
        gateway the others' part is zero but for that lag."""
        return self.inflight + self.others_load

    def answered_unreported(self) -> None:
        """An answer that did not say how much of its prompt was cached: unknown, not zero."""
        self.reports_cached = False
        self.unreported_answers += 1

    def observe_uncached(self, tokens: int) -> None:
        if self.mean_uncached is None:
            self.mean_uncached = float(tokens)
        else:
            self.mean_uncached += UNCACHED_SMOOTHING * (tokens - self.mean_uncached)

    def backlog(self, prompt_tokens: float) -> float:
        """Estimated uncached prompt tokens in flight here: its in-flight count (decoding
        requests included) x its recent mean; before the worker has answered anything, each
        request in flight counts as a whole prompt (a cold start's first wave)."""
        mean = prompt_tokens if self.mean_uncached is None else self.mean_uncached
        return self.inflight * mean

    @property
    def cached_first(self) -> bool:
        """Its scheduler runs the waiting prompts with the longest cached prefix first (ours by
        default, `/server_info` `schedule_policy: lpm`): a request that hits its cache there
        goes ahead of the colder prefill queued there."""
        return self.info is not None and self.info.schedule_policy == "lpm"

    def queued(self, prompt_tokens: float) -> float:
        """Uncached prompt tokens waiting for their prefill here. With its KV events followed:
        those of the requests whose prompt no event has stored yet; else `backlog`."""
        if self.kv_events_live:
            return sum(map(sum, self.awaiting_prefill.values()))
        return self.backlog(prompt_tokens)

    def take(self, wait: tuple[int, float] | None, sequences: int = 1) -> None:
        """A request is dispatched here; `wait` is `feedback.prefill_wait` of its decision,
        `sequences` its `RouteKey.sequences` (the worker's load report counts those)."""
        self.inflight += 1
        self.inflight_sequences += sequences
        if wait is not None:
            self.prefill_sent(*wait)

    def give_back(self, wait: tuple[int, float] | None, sequences: int = 1) -> None:
        """A request taken here is over (answered, failed or given up)."""
        self.inflight -= 1
        self.inflight_sequences -= sequences
        if wait is not None:
            self.prefill_ended(*wait)

    def prefill_sent(self, last_block: int, uncached_tokens: float) -> None:
        self.awaiting_prefill.setdefault(last_block, []).append(uncached_tokens)

    def prefill_stored(self, blocks: tuple[int, ...]) -> None:
        """A KV event stored `blocks`: the prefills whose prompt ends in one of them are done."""
        if self.awaiting_prefill:
            for h in blocks:
                self.awaiting_prefill.pop(h, None)

    def prefill_ended(self, last_block: int, uncached_tokens: float) -> None:
        """The request's answer ended (or it failed): stop waiting for its prefill, if still
        waiting (a prompt cached whole stores no block, and events can be missed)."""
        waiting = self.awaiting_prefill.get(last_block)
        if waiting and uncached_tokens in waiting:
            waiting.remove(uncached_tokens)
            if not waiting:
                del self.awaiting_prefill[last_block]

    def corrected(self, source: str) -> None:
        self.corrections[source] = self.corrections.get(source, 0) + 1


def candidates(workers: Sequence[Worker], key: RouteKey) -> list[Candidate]:
    """What a policy sees of `workers` for a request keyed `key`."""
    tokens = key.tokens
    return [Candidate(w.url, w.load, w.backlog(tokens), w.queued(tokens)) for w in workers]


MembershipHook = Callable[[Worker, bool], None]   # (worker, joined)
DrainHook = Callable[[], None]


class WorkerSet:
    def __init__(self, config: GatewayConfig, index: PrefixIndex, keys: KeyBuilder) -> None:
        self.config = config
        self.index = index
        self.keys = keys
        self.workers: dict[str, Worker] = {}
        # removed workers whose requests still run: one added back is the same worker (its
        # in-flight count, breaker and figures go on) rather than a new, seemingly idle one
        self._departed: dict[str, Worker] = {}
        self._models: set[str | None] | None = None   # the models served, when counted
        self.membership_hooks: list[MembershipHook] = []
        # some worker's queued prefill went down, or a worker joined or left the rotation
        self.drain_hooks: list[DrainHook] = []

    def drained(self) -> None:
        for hook in self.drain_hooks:
            hook()

    def __iter__(self):
        return iter(list(self.workers.values()))

    def __len__(self) -> int:
        return len(self.workers)

    @property
    def departed(self) -> list[Worker]:
        """Removed workers whose requests still run."""
        return [w for w in self._departed.values() if w.inflight]

    def get(self, url: str) -> Worker | None:
        return self.workers.get(url)

    def add(self, url: str, pod: str | None = None) -> Worker:
        """Add a worker (or clear `terminating` on a known one); the hooks hear of new ones.
        `host:port` and `http://host:port/` are one worker, whose watchers start once. `pod`,
        when given, is its pod's name (a known worker takes the new one: an address reused)."""
        url = normalize_worker_url(url)
        worker = self.workers.get(url)
        if worker is not None:
            if pod is not None:
                worker.pod = pod
            if worker.terminating:   # back in rotation: the held requests may go there now
                worker.terminating = False
                self.drained()
            return worker
        self._departed = {u: w for u, w in self._departed.items() if w.inflight}
        worker = self._departed.pop(url, None)
        if worker is not None:
            worker.removed = worker.terminating = False
            if pod is not None:
                worker.pod = pod
        else:
            cfg = self.config
            worker = Worker(url, HealthHysteresis(cfg.health_failures, cfg.health_successes),
                            CircuitBreaker(cfg.breaker_failures, cfg.breaker_open_seconds),
                            pod=pod)
        self.workers[url] = worker
        self._models = None
        self.index.add_worker(url, self.tree_capacity(None))
        if worker.info is not None:
            self.set_info(worker, worker.info)
        for hook in self.membership_hooks:
            hook(worker, True)
        return worker

    def remove(self, url: str) -> Worker | None:
        worker = self.workers.pop(normalize_worker_url(url), None)
        if worker is not None:
            worker.removed = True
            self._models = None
            self._departed = {u: w for u, w in self._departed.items() if w.inflight}
            if worker.inflight:
                self._departed[worker.url] = worker
            self.index.remove_worker(worker.url)
            for hook in self.membership_hooks:
                hook(worker, False)
        return worker

    def reconcile(self, ready: set[str], terminating: set[str],
                  pods: dict[str, str] | None = None) -> None:
        """Match discovery: add ready endpoints, drain terminating ones (they finish their
        streams but get no new requests), remove the ones that disappeared. `pods`: URL → the
        endpoint's pod name, where it names one."""
        ready = {normalize_worker_url(url) for url in ready}
        terminating = {normalize_worker_url(url) for url in terminating} - ready
        pods = {normalize_worker_url(url): pod for url, pod in (pods or {}).items()}
        for url in ready:
            self.add(url, pods.get(url))   # clears `terminating` on a worker that came back
        leaving = False
        for worker in self:
            if worker.url in terminating:
                leaving = leaving or not worker.terminating
                worker.terminating = True
                worker.pod = pods.get(worker.url, worker.pod)
            elif worker.url not in ready:
                self.remove(worker.url)
        if leaving:   # requests held for it as their cache owner may go elsewhere now
            self.drained()

    def eligible(self, now: float, model: str | None = None) -> list[Worker]:
        """The workers a new request may go to: for `model`, those serving it; when none of
        them is eligible but some worker is known to serve it, only workers whose model is not
        known yet (so the request waits or gets 503, not another model's 404); when no worker
        is known to serve it, all (one answers 404 naming it)."""
        ready = [w for w in self.workers.values() if w.eligible(now)]
        if model is not None:
            serving = [w for w in ready if w.model == model]
            if serving:
                return serving
            if self.serves(model):
                return [w for w in ready if w.model is None]
        return ready

    def serves(self, model: str) -> bool:
        """Whether some worker (eligible or not) is known to serve `model`."""
        if self._models is None:   # recounted only after the membership or a model changed
            self._models = {w.model for w in self.workers.values()}
        return model in self._models

    def set_info(self, worker: Worker, info: ServerInfo) -> None:
        if worker.model != info.served_model_name:
            self._models = None
        worker.info = info
        if worker.url in self.index:
            self.index.set_capacity(worker.url, self.tree_capacity(info.kv_capacity_tokens))
            self.index.set_eviction_policy(worker.url, info.eviction_policy)

    def tree_capacity(self, kv_tokens: int | None) -> int:
        """Tree bound in blocks: the worker's real KV capacity when known, else the fallback."""
        tokens = kv_tokens or self.config.tree_capacity_tokens
        if self.keys.tokenizer is not None:
            return max(1, tokens // self.keys.block_size)
        return max(1, tokens * BYTES_PER_TOKEN // self.keys.text_block_bytes)

    def resize_trees(self) -> None:
        """Key units changed (a tokenizer arrived): old hashes mean nothing now."""
        for worker in self.workers.values():
            self.index.reset(worker.url)
            kv = worker.info.kv_capacity_tokens if worker.info else None
            self.index.set_capacity(worker.url, self.tree_capacity(kv))
