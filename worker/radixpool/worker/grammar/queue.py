"""Constrained requests waiting for their grammar: the engine core's side of the compile thread.

A request with a constraint enters here instead of the scheduler's waiting queue. Each step the
core takes the requests whose grammar is ready (`ready`): they get their `RequestGrammar` and join
the scheduler; a grammar that failed to compile refuses its request with the compiler's message,
before any of it is decoded. Nothing here blocks a step except `wait`, which the core calls only
when it has nothing else to do.

A request waits at most `timeout_s` (`--grammar-compile-timeout`): then it is refused, naming
the constraint, and not left to its client's own timeout. A compile no request waits for any
more (they timed out or left) is called off if it has not started; one already running cannot be
stopped (xgrammar runs it in C++), so it goes on and its grammar is cached for the next request
with the same constraint.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures

from radixpool.worker.grammar.compiler import KIND_NAMES, GrammarCompiler, GrammarError
from radixpool.worker.grammar.matcher import RequestGrammar
from radixpool.worker.request import Req


class GrammarQueue:
    def __init__(self, compiler: GrammarCompiler, timeout_s: float) -> None:
        self.compiler = compiler
        self.timeout_s = timeout_s
        # rid -> the request, its compile, and when it stops waiting for it (time.monotonic)
        self._waiting: dict[str, tuple[Req, Future, float]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, req: Req) -> None:
        key = req.params.constraint
        assert key is not None
        self._waiting[req.rid] = (req, self.compiler.submit(key),
                                  time.monotonic() + self.timeout_s)

    def remove(self, rid: str) -> Req | None:
        entry = self._waiting.pop(rid, None)
        if entry is None:
            return None
        req, fut, _ = entry
        self._let_go(req, fut)
        return req

    def ready(self) -> list[tuple[Req, str | None]]:
        """Requests whose grammar is settled: (request, None) with `req.grammar` set, or
        (request, why it was refused)."""
        out = []
        now = time.monotonic()
        for rid in [rid for rid, (_, fut, due) in self._waiting.items()
                    if fut.done() or now >= due]:
            req, fut, _ = self._waiting.pop(rid)
            if not fut.done():
                out.append((req, self._timed_out(req, fut)))
                continue
            exc = fut.exception()
            if exc is None:
                req.grammar = RequestGrammar(fut.result(), self.compiler.vocab)
                out.append((req, None))
            elif isinstance(exc, GrammarError):
                out.append((req, str(exc)))
            else:
                out.append((req, f"the grammar could not be compiled: "
                                 f"{type(exc).__name__}: {exc}"))
        return out

    def wait(self, timeout_s: float) -> None:
        """Block until some grammar is settled or `timeout_s` passes."""
        wait_futures([fut for _, fut, _ in self._waiting.values()], timeout_s,
                     return_when=FIRST_COMPLETED)

    def _timed_out(self, req: Req, fut: Future) -> str:
        kind = req.params.constraint[0]
        self._let_go(req, fut)
        going_on = ("; it compiles on, and the same constraint sent again once it has compiled "
                    "is served at once" if fut.running() else "")
        return (f"{kind} did not compile within {self.timeout_s:g} s "
                f"(--grammar-compile-timeout): simplify the {KIND_NAMES[kind]}{going_on}")

    def _let_go(self, req: Req, fut: Future) -> None:
        """`req` waits no more for `fut`: called off if no other request waits for it."""
        if not any(other is fut for _, other, _ in self._waiting.values()):
            self.compiler.call_off(req.params.constraint, fut)
