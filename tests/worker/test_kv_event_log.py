"""The front end's KV-event log: resumable reads, gap detection, long-poll wake-ups."""

from __future__ import annotations

import asyncio

from radixpool.protocol.kv_blocks import KVEvent
from radixpool.worker.kv_event_log import LOAD_LINGER_S, KVEventLog


def events(first: int, last: int) -> list[KVEvent]:
    return [KVEvent(seq, "stored", (seq,), None) for seq in range(first, last + 1)]


def test_reads_resume_from_any_seq_and_report_gaps():
    log = KVEventLog(capacity=4)
    log.append(events(1, 6))  # 1 and 2 fell out of the ring
    assert [e.seq for e in log.events_since(2)] == [3, 4, 5, 6]
    assert [e.seq for e in log.events_since(5)] == [6]
    assert log.events_since(6) == []
    assert log.events_since(1) is None, "events 2.. were dropped: the reader must resync"


def test_long_prompts_events_are_bounded_by_blocks_and_a_reader_past_them_resyncs():
    log = KVEventLog(max_blocks=1000)
    for seq in range(1, 101):   # 100 prompts of 64 blocks each: 6,400 hashes
        log.append([KVEvent(seq, "queued", tuple(range(seq * 64, seq * 64 + 64)), None)])
    assert [e.seq for e in log.events_since(85)] == list(range(86, 101))   # 960 blocks kept
    assert log.events_since(84) is None, "event 85 was dropped: the reader must resync"
    log.append([KVEvent(101, "queued", tuple(range(5000)), None)])   # one over the budget alone
    assert [e.seq for e in log.events_since(100)] == [101]


def test_wait_wakes_on_new_events_and_leaves_no_waiters_behind():
    log = KVEventLog()

    async def scenario() -> None:
        for _ in range(5):  # idle long polls time out
            await log.wait(0, 0.01)
        assert not log._waiters
        waiter = asyncio.create_task(log.wait(0, 30))
        await asyncio.sleep(0.01)
        log.append(events(1, 1))
        await asyncio.wait_for(waiter, 2)  # woken well before its timeout
        assert not log._waiters

    asyncio.run(scenario())


def test_every_long_polling_reader_is_woken_and_reads_every_event():
    """Several gateways follow one worker: each keeps its own cursor into the one log."""
    log = KVEventLog()
    log.append(events(1, 3))

    async def reader(since: int, until: int) -> list[int]:
        seen: list[int] = []
        while since < until:
            batch = log.events_since(since)
            if batch == []:
                await log.wait(since, 5)
                continue
            seen += [e.seq for e in batch]
            since = batch[-1].seq
        return seen

    async def scenario() -> list[list[int]]:
        readers = [asyncio.create_task(reader(s, 9)) for s in (0, 3, 3)]
        for first in (4, 7):
            await asyncio.sleep(0.01)  # the readers are parked in wait()
            log.append(events(first, first + 2))
        return await asyncio.wait_for(asyncio.gather(*readers), 2)

    seen = asyncio.run(scenario())
    assert seen == [list(range(1, 10)), list(range(4, 10)), list(range(4, 10))]
    assert not log._waiters


def test_a_reader_watching_the_load_is_answered_once_it_changes_and_only_then():
    """`touch` says the worker's load changed. A reader that said which load it saw is answered
    once it differs, `LOAD_LINGER_S` later (one answer for a burst); a reader that did not ask
    for the load, or whose load is current again, keeps waiting for events."""
    log = KVEventLog()
    load = [0]

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        watcher = asyncio.create_task(log.wait(0, 30, lambda: load[0], 0))
        plain = asyncio.create_task(log.wait(0, 30))
        await asyncio.sleep(0.01)
        load[0] = 1                     # a request arrived and left again: nothing to say
        load[0] = 0
        log.touch()
        await asyncio.sleep(0.05)
        assert not watcher.done() and not plain.done()
        load[0] = 2                     # two arrived
        start = loop.time()
        log.touch()
        await asyncio.wait_for(watcher, 2)
        assert loop.time() - start >= LOAD_LINGER_S * 0.9
        assert not plain.done(), "a reader that did not ask for the load waits for events"
        log.append(events(1, 1))
        await asyncio.wait_for(plain, 2)
        assert not log._waiters

    asyncio.run(scenario())
