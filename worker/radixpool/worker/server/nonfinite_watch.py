"""Whether this worker's model still gives finite logits at all.

One request whose logits are NaN or infinite ends alone with a 500 `nonfinite_logits` (a poison
prompt that overflows fp16, say), and the gateway does not count that against the worker: it is
the request's doing. A worker whose *every* request ends so (a failing GPU, corrupted weights in
memory) must still leave the rotation, and only the worker can tell the two apart. Once the last
`window` requests that got as far as output all ended non-finite, it asks its model a question
of its own: a short greedy request with a fixed prompt (`PROBE_TOKENS`), the kind the warm-up
ran before the worker said ready. Finite: the prompts were at fault (one client repeating a
poison prompt, with no other traffic between), the run starts over and the worker keeps
serving. Non-finite too: the model is broken. Only requests that produced tokens or ended
non-finite count: a refusal, or a client that left before the first token, says nothing about
the logits. A probe that fails some other way (the engine is stopping) decides nothing.

Broken is for good (until the process restarts): `/health` and `/livez` answer 503, so the
gateway and the readiness probe stop sending requests, and the kubelet restarts the pod (a fresh
process, a fresh CUDA context, a reload of the weights). Out of rotation it gets no request that
could show it healthy again, so waiting for a finite one would leave it idle forever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("radixpool.worker.server")

PROBE_TOKENS = 8          # the probe's prompt: (7 i + 3) mod vocab, as the warm-up's begins
PROBE_OUTPUT_TOKENS = 4   # greedy, EOS ignored: a prefill and three decode steps

# the probe: True when the model's logits were finite, False when they were not; raises if it
# could not tell (the engine is gone or stopping)
Probe = Callable[[], Awaitable[bool]]


def probe_prompt(vocab_size: int, context_length: int | None = None) -> list[int]:
    """The self-check's prompt; shorter when the context cannot hold it and an output token."""
    room = PROBE_TOKENS if context_length is None else context_length - 1
    return [(7 * i + 3) % vocab_size for i in range(max(1, min(PROBE_TOKENS, room)))]


class NonfiniteWatch:
    def __init__(self, window: int, probe: Probe) -> None:
        self.window = window      # 0: never broken
        self.probe = probe
        self.run = 0              # consecutive counted requests that ended non-finite
        self.broken = False
        self.probes = 0           # probes run (each after a full run of non-finite requests)
        self._probing: asyncio.Task | None = None

    def finished(self, nonfinite: bool, produced: bool) -> None:
        """One request (one choice) ended: with non-finite logits, or after `produced` tokens."""
        if not nonfinite:
            if produced:
                self.run = 0
            return
        self.run += 1
        if (self.window and self.run >= self.window and not self.broken
                and self._probing is None):
            self._probing = asyncio.get_running_loop().create_task(self._check())

    async def _check(self) -> None:
        run = self.run
        self.probes += 1
        try:
            finite = await self.probe()
        except Exception as exc:   # no verdict: the next non-finite request probes again
            log.warning("after %d requests with non-finite logits, the model's self-check "
                        "could not run: %s", run, exc)
        else:
            self._judge(finite, run)
        finally:
            self._probing = None

    def _judge(self, model_finite: bool, run: int) -> None:
        if model_finite:
            log.warning("the last %d requests ended with non-finite logits, but the model's "
                        "self-check is finite: their prompts are at fault, not the model; "
                        "the worker keeps serving", run)
            self.run = 0
            return
        self.broken = True
        log.error("the last %d requests all ended with non-finite logits (NaN or infinity), "
                  "and so did the model's self-check: the model is broken on this worker, not "
                  "one prompt; /health and /livez now answer 503 until it restarts", run)

    @property
    def reason(self) -> str:
        return (f"the last {self.window} requests and a self-check all ended with non-finite "
                "logits; this worker's model is broken until it restarts")
