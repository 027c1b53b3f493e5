"""Errors the engine's callers act on (torch-free: the HTTP server maps them before the engine
has loaded)."""

from __future__ import annotations


class EngineBusy(RuntimeError):
    """A flush refused because requests are in flight (it never waits on them)."""

    def __init__(self, running: int, waiting: int) -> None:
        super().__init__(f"cannot flush the cache while requests are in flight: {running} "
                         f"running, {waiting} waiting; retry once the engine is idle")
        self.running, self.waiting = running, waiting


class RidInUse(ValueError):
    """A request id that names a request still in flight."""

    def __init__(self, rid: str) -> None:
        super().__init__(f"rid {rid!r} is already in flight; use a unique rid per request "
                         "(a finished request's rid may be reused)")
        self.rid = rid


class EngineStartCancelled(RuntimeError):
    """The caller gave up on an engine still starting (`Engine(cancel=...)` was set): its core
    process was stopped."""


class RequestFault(RuntimeError):
    """The engine, not the input, failed this one request (and no other): a 500 whose `code`
    says so (`radixpool.protocol.errors`), e.g. its logits were NaN or infinite."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code
