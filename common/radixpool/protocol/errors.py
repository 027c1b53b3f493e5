"""Error codes a worker puts in its answers that the gateway acts on.

A 5xx answer (or a stream's error event) normally says the worker is failing: the gateway's
circuit breaker counts it. A code in `REQUEST_SPECIFIC_CODES` says the opposite: the worker is
fine, this one request failed on its own (its logits overflowed to NaN, say). Counting those
would let one client that repeats a poison prompt open every worker's breaker in turn, so the
gateway passes them through and counts them neither way. A worker that fails *every* request so
takes itself out instead (its `/health` and `/livez`, see docs/worker.md).
"""

from __future__ import annotations

NONFINITE_LOGITS = "nonfinite_logits"   # 500 server_error: the model's logits were NaN / inf
# 500 server_error: turning the request's tokens into text (detokenizing, stop strings) failed,
# a bug meeting odd tokens; the other requests go on
OUTPUT_DECODE_FAILED = "output_decode_failed"

REQUEST_SPECIFIC_CODES = frozenset({NONFINITE_LOGITS, OUTPUT_DECODE_FAILED})

# The OpenAI SDKs' own header: "false" stops their automatic retries (by default twice, for a 408,
# 409, 429 or any 5xx). A request-specific 500 would fail the same way again, and the gateway's
# refusal of a quarantined request is the same answer for its whole time.
NO_RETRY = ("x-should-retry", "false")
