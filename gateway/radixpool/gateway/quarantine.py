"""Queries of death: a request that was in two workers' engines when each of them died is refused
for a while, so one poison request cannot take the fleet down worker by worker (the gateway's
retries, then the client's, would carry it from one worker to the next).

A worker whose engine core dies answers every request it held with 503 `engine_core_died`. One
such death proves nothing about a request (an out-of-memory kill or a device fault ends every
request in flight), so it is retried as usual; a second engine death under the same request is
not chance. Requests are known by a 16-byte digest of their body; an entry is forgotten
`ttl_s` after its last death, and at most `max_entries` are kept (the oldest go first). Pure:
the clock is passed in.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

ENGINE_DIED_CODE = b'"engine_core_died"'   # the worker's error.code, as it appears in its body


def engine_died(answer: bytes) -> bool:
    """Whether a worker's 503 says its engine died while it held the request."""
    return ENGINE_DIED_CODE in answer


class Quarantine:
    def __init__(self, deaths_to_refuse: int = 2, ttl_s: float = 600.0,
                 max_entries: int = 4096) -> None:
        self.deaths_to_refuse = deaths_to_refuse
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._deaths: OrderedDict[bytes, tuple[int, float]] = OrderedDict()  # digest -> (n, at)

    def died_holding(self, body: bytes, now: float) -> bool:
        """A worker's engine died while it held the request with this body. Returns whether
        the request is now refused."""
        self._expire(now)
        key = _digest(body)
        deaths = self._deaths.pop(key, (0, now))[0] + 1
        self._deaths[key] = (deaths, now)
        while len(self._deaths) > self.max_entries:
            self._deaths.popitem(last=False)
        return deaths >= self.deaths_to_refuse

    def refuses(self, body: bytes, now: float) -> bool:
        if not self._deaths:   # the common case costs no digest
            return False
        self._expire(now)
        entry = self._deaths.get(_digest(body))
        return entry is not None and entry[0] >= self.deaths_to_refuse

    def _expire(self, now: float) -> None:
        deaths = self._deaths
        while deaths:
            key, (_, at) = next(iter(deaths.items()))
            if now - at < self.ttl_s:
                break
            del deaths[key]


def _digest(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=16, person=b"rp-quarantine").digest()
