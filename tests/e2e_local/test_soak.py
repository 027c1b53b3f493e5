"""A bounded soak: mixed traffic at the fleet's capacity for SOAK_S seconds through the gateway.

Afterwards every request was answered or refused cleanly (a 4xx/503 with an error body, never
a dropped connection, a 5xx or a hang); no KV slot leaked on any worker (the engines ran
`--debug-invariants` at every idle moment and are still healthy; once idle, the KV slots in use
are exactly the radix cache's, and a flush frees all of them); and the resident memory of every
worker (with its engine core) and of the gateway stayed within RSS_GROWTH_BOUND of what it was
after the warm-up.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path

import openai
import pytest

from .fleet_probes import MODEL, eventually, long_text, rss_bytes, scrape

pytestmark = pytest.mark.slow

SOAK_S = 45.0
WARMUP_S = 8.0
CLIENTS = 10
RSS_GROWTH_BOUND = 0.15      # of the post-warm-up RSS ...
RSS_GROWTH_FLOOR = 48 << 20  # ... or this many bytes, whichever is larger


def _one_request(sdk: openai.OpenAI, rng: random.Random) -> str:
    """Send one request of a random kind; returns how it ended: ok, refused or abandoned."""
    kind = rng.choice(("chat", "chat", "chat_stream", "completion", "completion_stream",
                       "abandon", "bad", "long", "n2"))
    system = {"role": "system", "content": long_text(rng.randrange(6), 150)}
    user = {"role": "user", "content": f"question {rng.random()}"}
    tokens = rng.randint(1, 24)
    try:
        if kind == "chat":
            sdk.chat.completions.create(model=MODEL, messages=[system, user], max_tokens=tokens)
        elif kind == "chat_stream":
            list(sdk.chat.completions.create(model=MODEL, messages=[system, user],
                                             max_tokens=tokens, stream=True,
                                             stream_options={"include_usage": True}))
        elif kind == "completion":
            sdk.completions.create(model=MODEL, prompt=system["content"], max_tokens=tokens)
        elif kind == "completion_stream":
            list(sdk.completions.create(model=MODEL, prompt=user["content"], max_tokens=tokens,
                                        stream=True))
        elif kind == "abandon":
            stream = sdk.chat.completions.create(model=MODEL, messages=[system, user],
                                                 max_tokens=200, stream=True,
                                                 extra_body={"ignore_eos": True})
            for i, _ in enumerate(stream):
                if i == 3:
                    break
            stream.close()
            return "abandoned"
        elif kind == "bad":
            sdk.chat.completions.create(model=MODEL, messages=[user], max_tokens=-1)
        elif kind == "long":
            sdk.completions.create(model=MODEL, prompt=long_text(rng.randrange(10**6), 1500),
                                   max_tokens=tokens)
        else:
            sdk.completions.create(model=MODEL, prompt=user["content"], max_tokens=tokens, n=2,
                                   temperature=1.0)
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        clean = (exc.status_code < 500 or exc.status_code == 503) and "message" in body
        if clean:
            return "refused"
        raise
    return "ok"


def _memory(fleet) -> dict[str, int]:
    return {c.name: rss_bytes(c.pid) for c in (*fleet.workers, fleet.gateway)}


def test_bounded_soak_leaves_no_leak(fleet, sdk):
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + SOAK_S

    def client(seed: int) -> None:
        rng = random.Random(seed)
        quick = sdk.with_options(timeout=90)
        while time.monotonic() < deadline:
            try:
                how = _one_request(quick, rng)
            except Exception as exc:
                how = "failed"
                with lock:
                    failures.append(repr(exc))
            with lock:
                outcomes[how] += 1

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(CLIENTS)]
    for t in threads:
        t.start()
    time.sleep(WARMUP_S)
    warm = _memory(fleet)
    for t in threads:
        t.join(SOAK_S + 120)
    assert not any(t.is_alive() for t in threads), "a request hung"
    final = _memory(fleet)
    rate = sum(outcomes.values()) / SOAK_S
    print(f"\nsoak: {dict(outcomes)} ({rate:.0f} requests/s); RSS MiB after warm-up -> end: " +
          ", ".join(f"{name} {warm[name] >> 20} -> {final[name] >> 20}" for name in warm))

    assert failures == [], failures[:5]
    assert outcomes["ok"] > 100 and outcomes["refused"] > 0 and outcomes["abandoned"] > 0, \
        outcomes
    for name, before in warm.items():
        bound = max(before * RSS_GROWTH_BOUND, RSS_GROWTH_FLOOR)
        assert final[name] - before <= bound, \
            f"{name}: RSS {before >> 20} MiB after warm-up, {final[name] >> 20} MiB at the end"

    for i, url in enumerate(fleet.worker_urls):
        def idle(url=url) -> bool:
            m = scrape(url)
            return m["radixpool_num_requests_running"] == m["radixpool_num_requests_waiting"] == 0
        eventually(idle, f"{url} goes idle")
        assert fleet.workers[i].healthy(), f"{url} unhealthy after the soak: see its log"
        m = scrape(url)
        used = round(m["radixpool_kv_cache_usage_ratio"] * m["radixpool_kv_cache_capacity_tokens"])
        assert used == m["radixpool_radix_cache_tokens"], "KV slots held by no request"
        fleet.flush_worker(i)
        m = scrape(url)
        assert m["radixpool_kv_cache_usage_ratio"] == 0 and m["radixpool_radix_cache_tokens"] == 0
        assert fleet.workers[i].healthy()
        assert "invariant" not in Path(fleet.workers[i].log_path).read_text()
