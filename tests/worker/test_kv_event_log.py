"""The front end's KV-event log: resumable reads, gap detection, long-poll wake-ups."""

from __future__ import annotations

import asyncio

from radixpool.protocol.kv_blocks import KVEvent
from radixpool.worker.kv_event_log import KVEventLog


def events(first: int, last: int) -> list[KVEvent]:
    return [KVEvent(seq, "stored", (seq,), None) for seq in range(first, last + 1)]


def test_reads_resume_from_any_seq_and_report_gaps():
    log = KVEventLog(capacity=4)
    log.append(events(1, 6))  # 1 and 2 fell out of the ring
    assert [e.seq for e in log.events_since(2)] == [3, 4, 5, 6]
    assert [e.seq for e in log.events_since(5)] == [6]
    assert log.events_since(6) == []
    assert log.events_since(1) is None, "events 2.. were dropped: the reader must resync"


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
