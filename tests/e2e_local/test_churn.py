"""Planned churn under traffic, seen from an `openai` SDK client of the gateway: a worker restarted
(SIGTERM: it drains, then a new instance starts on its port) while streams run on every worker,
and the gateway restarted while the workers keep their caches. Each test leaves the fleet whole."""

from __future__ import annotations

import threading
import uuid

import pytest

from .fleet_probes import eventually, gateway_view, long_text, server_info
from .test_faults import JOIN_TIMEOUT_S, _ask, _streams_flowing

pytestmark = pytest.mark.slow


def test_a_worker_restarted_under_streams_drains_then_is_routed_to_afresh(fleet, sdk):
    streams, threads = _streams_flowing(sdk, 6, 120)
    victim = streams[0].worker
    index = fleet.worker_urls.index(victim)
    old_id = server_info(victim)["instance_id"]
    old_process = fleet.workers[index].proc

    asked_while_draining: list[object] = []
    restart = threading.Thread(target=fleet.restart_worker, args=(index,))
    restart.start()
    while restart.is_alive() and old_process.poll() is None:
        try:  # the worker drains: the gateway must stop sending it new requests
            asked_while_draining.append(
                _ask(sdk, f"while draining {uuid.uuid4().hex}").headers["x-radixpool-worker"])
        except Exception as exc:
            asked_while_draining.append(exc)
    restart.join(JOIN_TIMEOUT_S)
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    assert not restart.is_alive() and not any(t.is_alive() for t in threads), "hung"

    # every stream, the drained worker's too, ran to its end; no request failed meanwhile
    assert [(s.error, s.finish_reason) for s in streams] == [(None, "length")] * len(streams)
    assert not [a for a in asked_while_draining if isinstance(a, Exception)]
    assert victim in {s.worker for s in streams}
    assert len(asked_while_draining) > 1
    assert victim not in asked_while_draining[1:]  # the first may have left before the SIGTERM

    new_id = server_info(victim)["instance_id"]
    assert new_id != old_id
    eventually(lambda: gateway_view(fleet.gateway.url)[victim]["instance_id"] == new_id,
               "the gateway sees the new instance")
    fleet.wait_gateway_routes_to_all()
    # new sessions (a question, then a follow-up) reach the restarted worker again, and hit
    owners: dict[str, list[int]] = {}
    for session in range(2 * len(fleet.workers)):
        prompt = long_text(7000 + session)
        owner = _ask(sdk, prompt).headers["x-radixpool-worker"]
        follow = _ask(sdk, prompt + " and then?")
        assert follow.headers["x-radixpool-worker"] == owner
        owners.setdefault(owner, []).append(
            follow.parse().usage.prompt_tokens_details.cached_tokens)
    assert victim in owners, owners
    assert min(min(hits) for hits in owners.values()) > 180, owners


def test_a_restarted_gateway_rebuilds_its_trees_from_the_workers_kv_events(fleet, sdk):
    prompts = [long_text(8000 + i, 300) for i in range(2 * len(fleet.workers))]
    owners = [_ask(sdk, p).headers["x-radixpool-worker"] for p in prompts]
    assert len(set(owners)) > 1, owners
    trees = {url: w["tree_blocks"] for url, w in gateway_view(fleet.gateway.url).items()}

    fleet.restart_gateway()
    # before any request: the new gateway's trees hold what the workers hold (their KV events)
    eventually(lambda: all(w["tree_blocks"] >= trees[url] > 0 for url, w in
                           gateway_view(fleet.gateway.url).items() if url in set(owners)),
               "the new gateway's trees are rebuilt")
    for prompt, owner in zip(prompts, owners):
        again = _ask(sdk, prompt + " once more")
        assert again.headers["x-radixpool-worker"] == owner  # routed by cache, not by luck
        assert again.parse().usage.prompt_tokens_details.cached_tokens > 280
    view = gateway_view(fleet.gateway.url)
    predicted = sum(w["predicted_cached_tokens"] for w in view.values())
    cached = sum(w["cached_tokens"] for w in view.values())
    assert predicted > 280 * len(prompts) and abs(predicted - cached) <= 4 * len(prompts), \
        (predicted, cached)
