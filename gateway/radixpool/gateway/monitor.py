"""Background watchers, one set per worker: active health checks, the worker's identity and
capacity, the model's tokenizer, and the KV-event stream. All of them feed the pure state.

- Health: every `health_interval`, `GET /health`; results go through the hysteresis (N failures
  down, M successes up). A 503 marks the worker draining at once (no new requests); a 200 clears
  it. Coming back up closes the circuit breaker. A worker going out of rotation or back into it
  has the requests held by late binding offered again (`WorkerSet.drained`). Going down because
  the checks went unanswered (a hung worker, not a draining one) calls `hung`: the proxy retries
  elsewhere the requests still waiting there for their response headers.
- Identity: `GET /server_info` each round (`/get_server_info` for SGLang workers). A new
  `instance_id` (restart or `/flush_cache`) empties that worker's tree at once;
  `kv_capacity_tokens` (SGLang: `max_total_num_tokens`) sizes it.
- Tokenizer: without `--tokenizer`, the first worker that answers `GET /tokenizer` supplies it;
  the trees switch from text to token ids (and are emptied, their hashes meant bytes). It stays
  while some healthy worker serves the model it came from in the same block size; once none
  does (a rollout changed the model or the page size), the next worker checked supplies it
  again, and the trees are emptied and every KV stream resyncs in the new units.
- KV events (token mode, when the worker serves them and `--kv-events` is on): a long poll on
  `GET /kv_events?since=S` applies exact stores and evictions; a 409 or a new instance id resyncs
  from `/kv_events/snapshot` (a stream that fails again right after one waits before the next:
  a spin would walk the worker's cache thousands of times a second). While the stream is
  followed, `Worker.kv_events_live` is set. A snapshot of a new instance is that instance's
  tree: it takes the new id, so the identity check does not empty the tree a second time
  (losing what the new instance stored meanwhile).
- Placement, on the same stream: a `queued` event names the blocks of a prompt the worker has
  just queued, before its prefill computes them; they go into its tree as this gateway's own
  routing decisions do, so a prompt another gateway sent there is known within a step, not only
  when its prefill ends (`stored`).
- Load, on the same stream: each answer says how many requests the worker holds
  (`Worker.reported_load`), and each poll says the figure it last saw, so the worker also answers
  when it changes (about 10 ms later). Several gateways then count each other's requests, not
  only their own; a stream that stops being followed forgets the figure.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

from radixpool.gateway.metrics import GatewayMetrics
from radixpool.gateway.worker_info import INFO_PATHS, parse_server_info
from radixpool.gateway.workers import Worker, WorkerSet
from radixpool.protocol.kv_blocks import KVEvent, from_hex
from radixpool.protocol.server_info import ServerInfo
from radixpool.tokenization import PromptTokenizer

log = logging.getLogger("radixpool.gateway")

KV_POLL_SECONDS = 5.0
KV_RETRY_SECONDS = 0.5

# `GET path` from a worker → (status, body); raises OSError (ConnectionError) when unreachable
Fetch = Callable[[Worker, str], Awaitable[tuple[int, bytes]]]


class Monitor:
    """Watches the workers of a `WorkerSet`, reaching them only through `fetch`."""

    def __init__(self, workers: WorkerSet, fetch: Fetch, metrics: GatewayMetrics,
                 hung: Callable[[Worker], None] | None = None) -> None:
        self.workers = workers
        self.fetch = fetch
        self.hung = hung   # a worker whose checks went unanswered until it was taken down
        self.metrics = metrics
        self.config = workers.config
        self.index = workers.index
        self.keys = workers.keys
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self._tokenizer_lock = asyncio.Lock()
        # (model, kv_block_size) of the worker the tokenizer came from; None: none did
        self._tokenizer_from: tuple[str, int] | None = None
        workers.membership_hooks.append(self._membership)

    def start(self) -> None:
        for worker in self.workers:
            self._membership(worker, True)

    async def stop(self) -> None:
        pending = {t for ts in self._tasks.values() for t in ts}
        self._tasks.clear()
        while pending:
            # cancel again until done: Python 3.11's wait_for can swallow a cancellation that
            # races with its inner future finishing, and the watcher would sleep on
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.1)

    def _membership(self, worker: Worker, added: bool) -> None:
        if added:
            loop = asyncio.get_running_loop()
            self._tasks[worker.url] = [loop.create_task(self._watch(worker)),
                                       loop.create_task(self._kv_events(worker))]
        else:
            for task in self._tasks.pop(worker.url, []):
                task.cancel()

    async def _get_json(self, worker: Worker, path: str, timeout: float) -> tuple[int, object]:
        status, body = await asyncio.wait_for(self.fetch(worker, path), timeout)
        try:
            return status, json.loads(body) if body else None
        except ValueError:
            return status, None

    # --- health, identity, tokenizer ----------------------------------------------------------
    async def _watch(self, worker: Worker) -> None:
        while not worker.removed:
            try:
                await self.check(worker)
            except Exception:   # whatever a worker answers, its checks go on next round
                log.exception("health check of %s failed", worker.url)
            await asyncio.sleep(self.config.health_interval)

    async def check(self, worker: Worker) -> None:
        """One round of active checks (also callable directly by tests and at startup)."""
        timeout = self.config.health_timeout
        try:
            status, doc = await self._get_json(worker, "/health", timeout)
        except (asyncio.TimeoutError, OSError):
            status, doc = 0, None
        ok = status == 200
        serving = worker.health.healthy and not worker.draining
        worker.draining = status == 503
        code = doc.get("code") if isinstance(doc, dict) else None
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):   # an edge's refusal
            code = doc["error"].get("code")
        worker.health_failure = None if ok else {
            "status": status or None, "code": code if isinstance(code, str) else None}
        if worker.health.record(ok):   # True only when the verdict flipped
            log.warning("worker %s is now %s%s", worker.url, "healthy" if ok else "down",
                        f" ({status} {code})" if not ok and isinstance(code, str) else "")
            if ok:
                worker.breaker.reset()
            elif not status and self.hung is not None:   # unanswered, not draining (503)
                self.hung(worker)
        if (worker.health.healthy and not worker.draining) != serving:
            # back: the requests held in the gateway may go there now, not at their deadline;
            # out: those held for it as their cache owner may go elsewhere
            self.workers.drained()
        if not ok:
            return
        info = await self._server_info(worker, timeout)
        if info is not None:
            self.observe_identity(worker, info)
            if self.keys.tokenizer is None or self._tokenizer_outdated():
                await self._fetch_tokenizer(worker)

    async def _server_info(self, worker: Worker, timeout: float) -> ServerInfo | None:
        """The worker's description from the path it answered last, else from the other
        dialect's path (an SGLang server serves `/get_server_info`)."""
        paths = [worker.info_path, *(p for p in INFO_PATHS if p != worker.info_path)]
        for path in paths:
            try:
                status, doc = await self._get_json(worker, path, timeout)
            except (asyncio.TimeoutError, OSError):
                return None
            info = parse_server_info(doc) if status == 200 else None
            if info is not None:
                worker.info_path = path
                return info
        return None

    def observe_identity(self, worker: Worker, info: ServerInfo) -> None:
        if worker.instance_id is not None and info.instance_id != worker.instance_id:
            log.info("worker %s has a new instance id (restart or flush): forgetting its tree",
                     worker.url)
            self.index.reset(worker.url)
            worker.corrected("instance_id")
            self.metrics.corrected(worker.url, "instance_id")
        worker.instance_id = info.instance_id
        self.workers.set_info(worker, info)
        keys = self.keys
        if keys.tokenizer is not None and not keys.block_size_known:
            # a local tokenizer (--tokenizer): hash in the blocks the workers hash in, so their
            # KV events can correct the trees
            keys.use_tokenizer(keys.tokenizer, info.kv_block_size)
            self.workers.resize_trees()
            log.info("routing on token ids in %d-token blocks (from %s)", info.kv_block_size,
                     worker.url)

    def _tokenizer_outdated(self) -> bool:
        """The tokenizer came from a worker, and no healthy worker serves that model in that
        block size any more."""
        source = self._tokenizer_from
        return source is not None and not any(
            w.info is not None and w.health.healthy and (w.info.model, w.info.kv_block_size)
            == source for w in self.workers)

    async def _fetch_tokenizer(self, worker: Worker) -> None:
        async with self._tokenizer_lock:
            if worker.info is None or (self.keys.tokenizer is not None
                                       and not self._tokenizer_outdated()):
                return
            try:
                status, doc = await self._get_json(worker, "/tokenizer", 30.0)
                if status != 200 or not isinstance(doc, dict):
                    return
                tokenizer = PromptTokenizer(doc["files"])
            except Exception as exc:  # any failure leaves the gateway routing on text
                log.warning("could not use %s/tokenizer (routing on text): %r", worker.url, exc)
                return
            self.keys.use_tokenizer(tokenizer, worker.info.kv_block_size)
            self._tokenizer_from = (worker.info.model, worker.info.kv_block_size)
            self.workers.resize_trees()
            log.info("routing on token ids (tokenizer of %s from %s, block size %d)",
                     worker.info.model, worker.url, worker.info.kv_block_size)

    # --- KV events ----------------------------------------------------------------------------
    def _kv_usable(self, worker: Worker) -> bool:
        keys = self.keys
        return (self.config.kv_events and keys.tokenizer is not None and worker.info is not None
                and worker.info.kv_events and worker.info.kv_block_size == keys.block_size
                and worker.health.healthy)

    async def _kv_events(self, worker: Worker) -> None:
        since: int | None = None
        instance: str | None = None
        synced = False
        polled = False   # a poll succeeded since the last resync
        units = self.keys.generation   # the key units `since` was followed in
        while not worker.removed:
            if self.keys.generation != units:   # new units: the tree was emptied
                since, units = None, self.keys.generation
            usable = self._kv_usable(worker)
            self._follow(worker, usable and since is not None)
            if not usable:
                since = None
                self.index.stop_following(worker.url)
                await asyncio.sleep(min(self.config.health_interval, KV_RETRY_SECONDS))
                continue
            try:
                if since is None:
                    since, instance = await self._resync(worker, count=synced)
                    synced, polled = True, False
                    continue
                seen = worker.reported_load
                status, doc = await self._get_json(
                    worker, f"/kv_events?since={since}&timeout={KV_POLL_SECONDS}&queued=1"
                            + ("" if seen is None else f"&load={seen}"),
                    KV_POLL_SECONDS + self.config.health_timeout + 5)
                if status == 404:
                    log.info("worker %s serves no /kv_events; relying on cached_tokens", worker.url)
                    self._follow(worker, False)
                    self.index.stop_following(worker.url)
                    return
                if status != 200 or not isinstance(doc, dict) or doc["instance_id"] != instance:
                    if not polled:   # failing right after a snapshot: resyncing at once spins
                        raise ValueError(f"/kv_events answered {status} after a resync")
                    since = None
                    continue
                polled = True
                worker.observe_load(_reported_load(doc))
                stored = False
                for event in doc["events"]:
                    kv_event = KVEvent.from_json(event)
                    self.index.apply_event(worker.url, kv_event)
                    if kv_event.type == "stored":
                        worker.prefill_stored(kv_event.blocks)
                        stored = True
                if stored:
                    self.workers.drained()
                since = int(doc["next"])
            except (asyncio.TimeoutError, OSError, KeyError, ValueError, TypeError) as exc:
                log.debug("kv events from %s: %r", worker.url, exc)
                since = None
                self._follow(worker, False)
                self.index.stop_following(worker.url)
                await asyncio.sleep(min(self.config.health_interval, KV_RETRY_SECONDS))

    def _follow(self, worker: Worker, live: bool) -> None:
        """Whether the worker's KV events are followed now. A change moves its queued prefill
        from the events' count to the estimate from its answers, or back, which can free a
        worker for the requests held in the gateway: they are offered again at once, not when
        a request ends there."""
        changed = worker.kv_events_live != live
        worker.kv_events_live = live
        if not live:
            worker.observe_load(None)
        if changed:
            self.workers.drained()

    async def _resync(self, worker: Worker, count: bool) -> tuple[int, str]:
        """Replace the worker's tree by its snapshot; `count` a resync after the first sync.
        The prefills the gateway still waited for whose prompt the snapshot holds ended while
        the events were not followed."""
        status, doc = await self._get_json(worker, "/kv_events/snapshot", 30.0)
        if status != 200 or not isinstance(doc, dict):
            raise ValueError(f"snapshot answered {status}")
        blocks = from_hex(doc["blocks"])
        self.index.load_snapshot(worker.url, blocks)
        worker.prefill_stored(blocks)
        instance = str(doc["instance_id"])
        if worker.instance_id is not None and instance != worker.instance_id:
            # The tree now follows the new instance (restart or flush) from its snapshot on:
            # the identity check must not empty it again when it sees the same new id.
            log.info("worker %s has a new instance id (restart or flush): its tree is now its "
                     "snapshot", worker.url)
            worker.instance_id = instance
            worker.corrected("instance_id")
            self.metrics.corrected(worker.url, "instance_id")
        elif count:
            worker.corrected("kv_resync")
            self.metrics.corrected(worker.url, "kv_resync")
        return int(doc["seq"]), instance


def _reported_load(doc: dict) -> int | None:
    """The requests a `/kv_events` answer says the worker holds; None from a worker that does not
    say (an older one, or SGLang), or says something else than a count."""
    load = doc.get("load")
    requests = load.get("requests") if isinstance(load, dict) else None
    if isinstance(requests, int) and not isinstance(requests, bool) and requests >= 0:
        return requests
    return None
