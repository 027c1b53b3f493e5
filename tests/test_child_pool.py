"""Child processes for GIL-holding work on untrusted input: work that outlives its time or its
memory ends in `TooBig` and the pool serves the next call."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from radixpool.child_pool import ChildPool, TooBig


def test_work_that_hangs_is_cut_and_the_pool_serves_the_next_call():
    async def main() -> None:
        pool = ChildPool(1, 64 << 20, timeout_s=2)
        try:
            assert await pool.run(json.loads, "[1, 2]") == [1, 2]
            started = time.monotonic()
            with pytest.raises(TooBig, match="2 s"):
                await pool.run(time.sleep, 3600)   # as a child stuck in a lock would
            assert time.monotonic() - started < 10
            assert await pool.run(json.loads, '{"a": 1}') == {"a": 1}
        finally:
            pool.close()

    asyncio.run(main())


def test_work_past_the_memory_limit_raises_too_big_and_the_pool_serves_the_next_call():
    async def main() -> None:
        pool = ChildPool(1, 32 << 20)
        try:
            with pytest.raises(TooBig, match="memory limit"):
                await pool.run(json.loads, "[" + ",".join(["[1]"] * 2_000_000) + "]")
            assert await pool.run(json.loads, "[3]") == [3]
        finally:
            pool.close()

    asyncio.run(main())


def test_work_queued_behind_busy_children_is_not_cut_by_the_time_limit():
    # The limit is for a call's own time: counted from submission, a backlog of legitimate
    # large bodies timed out the later ones (and killed the children doing the earlier ones).
    async def main() -> None:
        pool = ChildPool(1, 64 << 20, timeout_s=2.5)
        try:
            await pool.run(json.loads, "[0]")   # started: the spawn is not part of the test
            done = await asyncio.gather(*(pool.run(time.sleep, 1.0) for _ in range(4)))
            assert done == [None] * 4
        finally:
            pool.close()

    asyncio.run(main())


def test_a_caller_that_leaves_frees_no_busy_child_and_what_it_left_is_still_cut():
    # A client that disconnects cancels its caller: its child kept working, but its slot was
    # free at once, so the next call queued behind it on the clock; and a call left hanging
    # was never cut, holding its child for good.
    async def main() -> None:
        pool = ChildPool(1, 64 << 20, timeout_s=1.5)
        try:
            await pool.run(json.loads, "[0]")   # started: the spawn is not part of the test
            left = asyncio.create_task(pool.run(time.sleep, 1.0))
            await asyncio.sleep(0.2)
            left.cancel()
            assert await pool.run(time.sleep, 1.0) is None   # waits for the child, then runs
            hung = asyncio.create_task(pool.run(time.sleep, 3600))
            await asyncio.sleep(0.2)
            hung.cancel()
            assert await pool.run(json.loads, "[1]") == [1]   # after the hung call is cut
        finally:
            pool.close()

    asyncio.run(asyncio.wait_for(main(), 60))
