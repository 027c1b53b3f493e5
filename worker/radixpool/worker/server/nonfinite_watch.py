"""Whether this worker's model still gives finite logits at all.

One request whose logits are NaN or infinite ends alone with a 500 `nonfinite_logits` (a poison
prompt that overflows fp16, say), and the gateway does not count that against the worker: it is
the request's doing. A worker whose *every* request ends so (a failing GPU, corrupted weights in
memory) must still leave the rotation, and only the worker can tell the two apart: once the last
`window` requests that got as far as output all ended non-finite, it is broken. Only requests
that produced tokens or ended non-finite count: a refusal, or a client that left before the first
token, says nothing about the logits.

Broken is for good (until the process restarts): `/health` and `/livez` answer 503, so the
gateway and the readiness probe stop sending requests, and the kubelet restarts the pod (a fresh
process, a fresh CUDA context, a reload of the weights). Out of rotation it gets no request that
could show it healthy again, so waiting for a finite one would leave it idle forever.
"""

from __future__ import annotations

import logging

log = logging.getLogger("radixpool.worker.server")


class NonfiniteWatch:
    def __init__(self, window: int) -> None:
        self.window = window      # 0: never broken
        self.run = 0              # consecutive counted requests that ended non-finite
        self.broken = False

    def finished(self, nonfinite: bool, produced: bool) -> None:
        """One request (one choice) ended: with non-finite logits, or after `produced` tokens."""
        if not nonfinite:
            if produced:
                self.run = 0
            return
        self.run += 1
        if self.window and self.run >= self.window and not self.broken:
            self.broken = True
            log.error("the last %d requests all ended with non-finite logits (NaN or "
                      "infinity): the model is broken on this worker, not one prompt; /health "
                      "and /livez now answer 503 until it restarts", self.run)

    @property
    def reason(self) -> str:
        return (f"the last {self.window} requests all ended with non-finite logits; this "
                "worker's model is broken until it restarts")
