"""Child processes for work that holds the GIL on untrusted input: parsing large request bodies.

`json.loads` and pydantic's JSON validation hold the GIL for a whole call, and their cost follows
the number of values in a body, not only its bytes: 32 MiB of `[[1], [1], ...]` takes seconds and
more than half a GiB. Run on an event loop, or on a thread beside it, such a body stops every other
request for as long as it takes. `ChildPool` runs that work in spawned child processes instead
(started on first use). Each child may grow by `memory_bytes` beyond what it holds once started
(`RLIMIT_DATA`: past it, an allocation fails and the work raises `MemoryError`) and asks the
kernel to kill it first when the container runs out of memory. A child that dies costs the work
it held one more try on a fresh pool. Work that does not finish within `timeout_s` has its
children killed: native code that meets a failed allocation may abort, but it can also hang (a
Rust library did, in a lock on its way to aborting). Work that cannot finish within the memory or
the time raises `TooBig`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import multiprocessing
import resource
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

log = logging.getLogger("radixpool")


class TooBig(Exception):
    """The work could not be done within the children's memory or time limit; the message
    names which ("memory limit of N bytes", "time limit of N s")."""


class ChildPool:
    def __init__(self, processes: int, memory_bytes: int, preload: tuple[str, ...] = (),
                 initializer: Callable[..., None] | None = None, initargs: tuple = (),
                 timeout_s: float = 30.0) -> None:
        """`preload`: the modules the work's functions and arguments live in, imported before
        the memory limit is set (else the first task's unpickling imports them under it)."""
        self.processes = processes
        self.memory_bytes = memory_bytes
        self.preload = preload
        self.timeout_s = timeout_s
        self._setup = (initializer, initargs)
        self._pool: ProcessPoolExecutor | None = None
        # at most one call per child at a time: work waits here, not in the executor's queue,
        # so `timeout_s` counts a call's own time, never the time it queued behind others
        self._slots = asyncio.Semaphore(processes)

    def restart(self, initializer: Callable[..., None] | None, initargs: tuple = ()) -> None:
        """Later work runs in children set up this way; the current ones finish what they hold."""
        self._setup = (initializer, initargs)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in a child (both picklable by reference); raises what `fn` raises, or
        `TooBig`."""
        for _ in range(2):   # a child killed while it held this work and others': once more
            expired: list[bool] = []
            pool, work = await self._submit(fn, args, expired)
            try:
                return await asyncio.shield(work)
            except MemoryError:
                break
            except BrokenProcessPool:
                if expired:
                    raise TooBig(f"time limit of {self.timeout_s:g} s") from None
                log.warning("a child process died; starting new ones")
                self._discard(pool)
        raise TooBig(f"memory limit of {self.memory_bytes} bytes")

    async def _submit(self, fn: Callable[..., Any], args: tuple, expired: list[bool]
                      ) -> tuple[ProcessPoolExecutor, asyncio.Future]:
        """The call, started in a child once one is free. Its slot and its time limit follow the
        call, not the caller: a caller that leaves (its client disconnected) frees no child
        that is still busy, and what it left running is still cut at `timeout_s`."""
        loop = asyncio.get_running_loop()
        await self._slots.acquire()
        pool = self._current()
        try:
            work = loop.run_in_executor(pool, fn, *args)
        except BrokenProcessPool as exc:   # found broken at submission: the call fails at once
            work = loop.create_future()
            work.set_exception(exc)
        except BaseException:
            self._slots.release()
            raise
        timer = loop.call_later(self.timeout_s, self._expire, pool, work, expired)

        def finished(_: asyncio.Future) -> None:
            timer.cancel()
            self._slots.release()

        work.add_done_callback(finished)
        return pool, work

    def _expire(self, pool: ProcessPoolExecutor, work: asyncio.Future,
                expired: list[bool]) -> None:
        if not work.done():
            expired.append(True)
            self._discard(pool, kill=True)   # the call ends with BrokenProcessPool

    def _discard(self, pool: ProcessPoolExecutor, kill: bool = False) -> None:
        if pool is self._pool:
            self._pool = None
        if kill:
            _kill_children(pool)
        pool.shutdown(wait=False, cancel_futures=True)

    def _current(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.processes, mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_child,
                initargs=(self.memory_bytes, self.preload, *self._setup))
        return self._pool

    def close(self) -> None:
        """For good, at shutdown: the children are killed (what they hold is abandoned) and the
        executor's manager thread has ended when this returns. Left running, that thread can
        be closing its wake-up pipe just as the interpreter's exit hook writes to it (Python
        3.11): a traceback (EBADF) in the log of a server that stopped cleanly."""
        pool, self._pool = self._pool, None
        if pool is not None:
            _kill_children(pool)
            pool.shutdown(wait=True, cancel_futures=True)


def _kill_children(pool: ProcessPoolExecutor) -> None:
    """The executor has no public way to stop a running call: kill its processes."""
    for process in list(getattr(pool, "_processes", {}).values()):
        process.kill()


def _start_child(memory_bytes: int, preload: tuple[str, ...],
                 initializer: Callable[..., None] | None, initargs: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's to handle
    for module in preload:
        importlib.import_module(module)
    if initializer is not None:
        initializer(*initargs)
    # first to go when the container runs out of memory
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    used = _data_bytes()
    if used is not None:
        limit = used + memory_bytes
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _data_bytes() -> int | None:
    """This process's data segment as `RLIMIT_DATA` counts it (`VmData`), None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
