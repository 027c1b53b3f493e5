"""The gateway's count of prefill work queued at each worker: what it sent there, less what the
worker's KV events say was cached (a prefill ends by caching its prompt), less what ended."""

from __future__ import annotations

import pytest

from radixpool.gateway.breaker import CircuitBreaker
from radixpool.gateway.feedback import prefill_wait
from radixpool.gateway.health import HealthHysteresis
from radixpool.gateway.policies import Decision
from radixpool.gateway.route_key import BYTES_PER_TOKEN, KeyBuilder
from radixpool.gateway.workers import Worker
from radixpool.protocol.kv_blocks import DEFAULT_BLOCK_SIZE

BLOCK = DEFAULT_BLOCK_SIZE


def worker(events: bool = True) -> Worker:
    return Worker("http://w:1", HealthHysteresis(1, 1), CircuitBreaker(5, 10.0),
                  kv_events_live=events)


def test_a_prefill_waits_until_the_event_storing_its_last_block_or_its_end():
    w = worker()
    w.inflight = 2
    w.prefill_sent(111, 800.0)
    w.prefill_sent(222, 40.0)
    assert w.queued(5000) == 840.0
    w.prefill_stored((5, 111))                 # the first prompt's prefill ended
    assert w.queued(5000) == 40.0
    w.prefill_ended(111, 800.0)                # its answer ends later: nothing left to remove
    assert w.queued(5000) == 40.0
    w.prefill_ended(222, 40.0)                 # a prompt cached whole stores no block
    assert w.queued(5000) == 0.0 and not w.awaiting_prefill


def test_identical_prompts_wait_apart_and_one_stored_event_ends_both():
    w = worker()
    w.prefill_sent(7, 100.0)
    w.prefill_sent(7, 100.0)
    w.prefill_ended(7, 100.0)
    assert w.queued(0) == 100.0
    w.prefill_stored((7,))
    assert w.queued(0) == 0.0


def test_without_kv_events_the_queue_is_the_in_flight_estimate():
    w = worker(events=False)
    w.inflight = 3
    w.prefill_sent(1, 900.0)
    assert w.queued(64) == 3 * 64      # no answer yet: each in flight counts as a whole prompt
    w.observe_uncached(10)
    assert w.queued(64) == 30 == w.backlog(64)


def test_prefill_wait_is_the_uncached_part_the_tree_predicts_in_tokens():
    keys = KeyBuilder(64, 256)
    exact = keys.build("/generate", {"input_ids": list(range(10 * BLOCK + 5))})
    assert prefill_wait(Decision("w", "cache_hit", 4), exact) == (exact.hashes[-1], 6 * BLOCK + 5)
    text = keys.build("/v1/completions", {"model": "m", "prompt": "x" * 4000})
    last, tokens = prefill_wait(Decision("w", "cache_miss", 0), text)
    assert last == text.hashes[-1] and tokens == pytest.approx(4000 / BYTES_PER_TOKEN, rel=0.05)
    short = keys.build("/generate", {"input_ids": [1, 2, 3]})
    assert prefill_wait(Decision("w", "cache_miss", 0), short) is None
