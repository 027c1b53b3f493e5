"""Error events inside a stream: the status a stream that failed after its 200 stands for.

A worker that fails mid-stream cannot change its status any more: it ends the stream with an
event `data: {"error": {"message", "type", "param", "code"}}` (then `[DONE]`). The gateway takes
the status the error would have had as an answer: a numeric 4xx/5xx `code` (vLLM and SGLang send
one), else the OpenAI `type`'s (`invalid_request_error` 400, `authentication_error` 401,
`permission_error` 403, `not_found_error` 404, `service_unavailable` 503), else 500: a
`server_error`, an engine that died, an unlabelled or unreadable error. The metrics count the
request under that status, so bounded to 400-599 (a worker that answers 200 and fails every
stream is not a 0% error rate); the breaker counts a 5xx against the worker, as a 5xx answer
would be, and a 4xx (e.g. a RadixPool worker's `invalid_request_error` when the request's
grammar cannot go on) not: that is the request's doing.

Checked on the events the proxy relays anyway: a substring test per chunk, and a JSON parse only
of an event that starts with `{"error"` (a token's text cannot: its quotes are escaped).
"""

from __future__ import annotations

import json
import re

TYPE_STATUS = {"invalid_request_error": 400, "authentication_error": 401,
               "permission_error": 403, "not_found_error": 404, "service_unavailable": 503}
_ERROR_EVENT = re.compile(rb'^data: ?(\{"error".*)$', re.MULTILINE)


def error_status(events: bytes) -> int | None:
    """The status of the first error event in `events` (whole SSE events); None without one."""
    if b'{"error"' not in events:
        return None
    event = _ERROR_EVENT.search(events)
    return None if event is None else _status_of(event.group(1))


def _status_of(event: bytes) -> int:
    try:
        error = json.loads(event).get("error")
    except ValueError:
        return 500
    if not isinstance(error, dict):
        return 500
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool):
        return code if 400 <= code < 600 else 500
    return TYPE_STATUS.get(error.get("type"), 500)
