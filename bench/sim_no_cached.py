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

import argparse
import asyncio
import json
import re
import sys

from bench.simfleet import SimConfig, SimFleet, SimWorker
from bench.simfleet.fleet import add_arguments

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
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args()
    config = SimConfig(kv_capacity_tokens=args.kv_capacity_tokens, block_size=args.block_size,
                       eviction_policy=args.eviction_policy,
                       prefill_us_per_token=args.prefill_us_per_token,
                       decode_ms_per_token=args.decode_ms_per_token, kv_events=args.kv_events)

    async def run() -> None:
        fleet = SimFleet(args.count, config)
        for worker in fleet.workers:
            omit_cached_tokens(worker)
        await fleet.start(args.host, args.port)
        print(json.dumps({"urls": fleet.urls}), flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(run())
    except KeyboardInterrupt:
        pass
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
