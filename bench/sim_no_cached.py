"""Simulated workers whose answers leave `cached_tokens` out, like a vLLM server without
prompt-token details or an OpenAI-compatible server without usage details: `usage` keeps
`prompt_tokens` and loses `prompt_tokens_details`, `/generate`'s `meta_info` loses
`cached_tokens`. Their caches, KV events and `/sim/stats` are untouched, so the fleet's real hit
rate is still measured.

    python -m bench.sim_no_cached --count 4 [the flags of `python -m bench.simfleet`]

prints `{"urls": [...]}` like `python -m bench.simfleet` and serves until killed. Tests use
`omit_cached_tokens(worker)` on a running fleet's workers.
"""

from __future__ import annotations

import re
import sys

from bench.simfleet import SimFleet, SimWorker
from bench.simfleet.fleet import main as fleet_main

_CACHED = re.compile(rb',\s*"(?:prompt_tokens_details"\s*:\s*\{[^{}]*\}|cached_tokens"\s*:\s*\d+)')


def strip_cached(data: bytes) -> bytes:
    return _CACHED.sub(b"", data)


class _StrippingResponder:
    """The worker's responder, with `cached_tokens` cut out of everything written."""

    def __init__(self, respond) -> None:
        self._respond = respond

    def __getattr__(self, name: str):
        return getattr(self._respond, name)

    async def send(self, status: int, headers, body: bytes) -> None:
        await self._respond.send(status, headers, strip_cached(body))

    async def write(self, data: bytes) -> None:
        await self._respond.write(strip_cached(data))


def omit_cached_tokens(worker: SimWorker) -> None:
    generate = worker.generate

    async def generate_without_cached(request, respond) -> None:
        await generate(request, _StrippingResponder(respond))

    worker.generate = generate_without_cached


def main() -> int:
    def silence(fleet: SimFleet) -> None:
        for worker in fleet.workers:
            omit_cached_tokens(worker)

    return fleet_main(prepare=silence)

if __name__ == "__main__":
    sys.exit(main())
