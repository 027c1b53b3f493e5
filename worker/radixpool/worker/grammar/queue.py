"""Constrained requests waiting for their grammar: the engine core's side of the compile thread.

A request with a constraint enters here instead of the scheduler's waiting queue. Each step the
core takes the requests whose grammar is ready (`ready`): they get their `RequestGrammar` and join
the scheduler; a grammar that failed to compile refuses its request with the compiler's message,
before any of it is decoded. Nothing here blocks a step except `wait`, which the core calls only
when it has nothing else to do.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures

from radixpool.worker.grammar.compiler import GrammarCompiler, GrammarError
from radixpool.worker.grammar.matcher import RequestGrammar
from radixpool.worker.request import Req


class GrammarQueue:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._waiting: dict[str, tuple[Req, Future]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, req: Req) -> None:
        key = req.params.constraint
        assert key is not None
        self._waiting[req.rid] = (req, self.compiler.submit(key))

    def remove(self, rid: str) -> Req | None:
        entry = self._waiting.pop(rid, None)
        return None if entry is None else entry[0]

    def ready(self) -> list[tuple[Req, str | None]]:
        """Requests whose grammar is settled: (request, None) with `req.grammar` set, or
        (request, why it was refused)."""
        out = []
        for rid in [rid for rid, (_, fut) in self._waiting.items() if fut.done()]:
            req, fut = self._waiting.pop(rid)
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
        wait_futures([fut for _, fut in self._waiting.values()], timeout_s,
                     return_when=FIRST_COMPLETED)
