"""KV accounting under pressure, as a property: random workloads on pools barely large enough.

Prompts from a few shared stems (so the radix cache shares and splits), random max tokens, stop
tokens, cache salts, late arrivals, aborts and flushes, page sizes 1, 4 and 16, a context that may
end generations, every eviction and schedule policy, requests past the starvation bound or not,
the real scheduler with a fake model that reads its KV back (`kv_driver`). After every step: no
slot leaked or owned twice, lock counts balanced, cached (evictable + protected) + free + owned by
requests = capacity, and the scheduler makes progress whenever it has work. At the end every
request finished with exactly its tokens, or was aborted by us — with the synchronous loop and
with the overlapped one (step N+1 scheduled before step N's tokens reach the host), so both give
the same tokens.

CI runs a bounded number of examples; RADIXPOOL_HYPOTHESIS_EXAMPLES=N runs more.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from kv_driver import Loop, Outcome, collect, expected_output, make_scheduler, pages

from radixpool.worker.request import Req
from radixpool.worker.sampling_params import SamplingParams

EXAMPLES = int(os.environ.get("RADIXPOOL_HYPOTHESIS_EXAMPLES", "60"))


@st.composite
def workloads(draw):
    page_size = draw(st.sampled_from([1, 4, 16]))
    context = draw(st.sampled_from([4096, 4096, 24, 48]))
    stems = draw(st.lists(st.lists(st.integers(5, 60), min_size=0, max_size=40),
                          min_size=1, max_size=3))
    reqs = []
    for _ in range(draw(st.integers(1, 8))):
        stem = draw(st.sampled_from(stems))
        cut = draw(st.integers(0, len(stem)))
        tail = draw(st.lists(st.integers(5, 60), min_size=1, max_size=30))
        reqs.append({
            "prompt": (stem[:cut] + tail)[:context - 1],
            "salt": draw(st.sampled_from([None, None, "", "a"])),
            "max_new": draw(st.integers(1, 24)),
            "stop": draw(st.sampled_from([(), (), (7,), (11, 23)])),
            "min_new": draw(st.sampled_from([0, 0, 3])),
            "arrive": draw(st.integers(0, 12)),
            "abort": draw(st.one_of(st.none(), st.none(), st.integers(0, 30))),
        })
    need = max(pages(min(len(r["prompt"]) + r["max_new"], context), page_size) for r in reqs)
    return {
        "page_size": page_size,
        "context": context,
        "eviction": draw(st.sampled_from(["lru", "lfu", "probation"])),
        "schedule": draw(st.sampled_from(["lpm", "fcfs"])),
        "starving": draw(st.booleans()),   # arrived long ago: offered in arrival order
        "capacity": (need + draw(st.integers(0, 3))) * page_size,
        "chunk": page_size * draw(st.sampled_from([1, 2, 4, 16])),
        "prefill": draw(st.integers(1, 3)),
        "max_running": draw(st.integers(1, 8)),
        "flush_at": draw(st.lists(st.integers(0, 40), max_size=3)),
        "reqs": reqs,
        "overlap": draw(st.booleans()),
        "oversize_at": draw(st.one_of(st.none(), st.integers(0, 12))),
    }


def check_accounting(sched) -> None:
    sched.check_invariants()
    pool, cache = sched.pool, sched.cache
    ps = pool.page_size
    owned = 0
    for req in sched.running.values():
        owned += pages(req.kv_len, ps) - req.prefix_len // ps
    assert (cache.evictable_size + cache.protected_size) % ps == 0
    assert cache.evictable_size + cache.protected_size + pool.available_size() + owned * ps \
        == pool.capacity, "evictable + protected + free + owned != capacity"
    for rid in list(sched.waiting._members):
        req = sched.waiting.get(rid)
        assert req.row is None and req.last_node is None, "a waiting request holds KV"


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_kv_accounting_holds_under_pressure(w):
    note(repr(w))
    sched, model = make_scheduler(w["page_size"], w["capacity"], chunk=w["chunk"],
                                  max_prefill=w["chunk"] * w["prefill"],
                                  max_running=w["max_running"], context=w["context"],
                                  eviction_policy=w["eviction"], schedule_policy=w["schedule"])
    loop = Loop(sched, model, overlap=w["overlap"])
    outcomes: dict[str, Outcome] = {}
    aborted: set[str] = set()
    for t in range(3000):
        for i, r in enumerate(w["reqs"]):
            rid = f"r{i}"
            if r["arrive"] == t:
                params = SamplingParams(max_new_tokens=r["max_new"], stop_token_ids=r["stop"],
                                        min_new_tokens=min(r["min_new"], r["max_new"]))
                arrival = float(t) if w["starving"] else 1e12
                delta = sched.add(Req(rid, list(r["prompt"]), params, 0, r["salt"],
                                      arrival_time=arrival))
                if delta is not None:
                    collect(outcomes, [delta])
            if r["abort"] == t and r["arrive"] <= t:
                delta = sched.abort(rid)
                if delta is not None:
                    aborted.add(rid)
                    collect(outcomes, [delta])
        if t == w["oversize_at"]:   # a prompt this pool can never hold: refused, clearly
            delta = sched.add(Req("oversize", [9] * w["capacity"], SamplingParams(), 0))
            assert delta.finished and delta.finish_reason == "abort"
            assert f"{w['capacity']} tokens" in delta.error
        if t in w["flush_at"] and not loop.has_work:
            sched.cache.reset()
        if loop.has_work:
            loop.step(outcomes)
        check_accounting(sched)
        if t > 12 and not loop.has_work:
            break
    assert not loop.has_work, "requests left over after 3000 steps"
    event("retracted" if sched.retracted_total else "no retraction")
    assert sched.cache.protected_size == 0 and sched.rows.num_free() == sched.rows.table.shape[0]

    for i, r in enumerate(w["reqs"]):
        rid = f"r{i}"
        got = outcomes[rid]
        want, reason = expected_output(r["prompt"], r["max_new"], r["stop"],
                                       min(r["min_new"], r["max_new"]))
        if len(r["prompt"]) + len(want) > w["context"]:   # the context ends it first
            want, reason = want[:w["context"] - len(r["prompt"])], "length"
        assert got.error is None, got
        if rid in aborted:
            assert got.finish_reason == "abort" and got.tokens == want[:len(got.tokens)]
        else:
            assert (got.tokens, got.finish_reason) == (want, reason), rid
