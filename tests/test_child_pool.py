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
