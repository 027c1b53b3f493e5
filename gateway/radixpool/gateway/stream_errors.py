"""Error events inside a stream: whose fault a stream that failed after its 200 was.

A worker that fails mid-stream cannot change its status any more: it ends the stream with an
event `data: {"error": {"message", "type", "param", "code"}}` (then `[DONE]`). The breaker must
count it as the 200 it came under would not: a worker that fails every stream half-way still
answers 200 to all of them. Only the worker's own failures count: an error labelled as the
client's (OpenAI's 4xx `type`s, e.g. a RadixPool worker's `invalid_request_error` when the
request's grammar cannot go on; or a numeric 4xx `code`, as vLLM and SGLang send) is the
request's doing, as a 4xx status would be. Any other error event (`server_error`, an engine that
died, an unlabelled or unreadable one) is the worker's.

Checked on the events the proxy relays anyway: a substring test per chunk, and a JSON parse only
of an event that starts with `{"error"` (a token's text cannot: its quotes are escaped).
"""

from __future__ import annotations

import json
import re

CLIENT_ERROR_TYPES = frozenset((
    "invalid_request_error", "authentication_error", "permission_error", "not_found_error"))
_ERROR_EVENT = re.compile(rb'^data: ?(\{"error".*)$', re.MULTILINE)


def worker_failed_in(events: bytes) -> bool:
    """Whether `events` (whole SSE events) hold an error event of the worker's own making."""
    if b'{"error"' not in events:
        return False
    return any(_worker_at_fault(event) for event in _ERROR_EVENT.findall(events))


def _worker_at_fault(event: bytes) -> bool:
    try:
        error = json.loads(event).get("error")
    except ValueError:
        return True
    if not isinstance(error, dict):
        return True
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool):
        return not 400 <= code < 500
    return error.get("type") not in CLIENT_ERROR_TYPES
