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
grammar cannot go on) not: that is the request's doing. Neither does a 5xx whose string `code`
says the worker failed that one request alone (`protocol.errors.REQUEST_SPECIFIC_CODES`, e.g.
`nonfinite_logits`): one client repeating a poison prompt must not open every worker's breaker.
A whole answer's error body is read the same way (`answer_error`).

Checked on the events the proxy relays anyway: a substring test per chunk, and a JSON parse only
of an event that starts with `{"error"` (a token's text cannot: its quotes are escaped).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from radixpool.protocol.errors import REQUEST_SPECIFIC_CODES

TYPE_STATUS = {"invalid_request_error": 400, "authentication_error": 401,
               "permission_error": 403, "not_found_error": 404, "service_unavailable": 503}
_ERROR_EVENT = re.compile(rb'^data: ?(\{"error".*)$', re.MULTILINE)


@dataclass(frozen=True)
class WorkerError:
    status: int               # what the error stands for, 400-599
    code: str | None = None   # its machine-readable reason, when it has a string one

    @property
    def request_specific(self) -> bool:
        """The worker failed this request alone: no sign of a failing worker."""
        return self.code in REQUEST_SPECIFIC_CODES


def error_event(events: bytes) -> WorkerError | None:
    """The first error event in `events` (whole SSE events); None without one."""
    if b'{"error"' not in events:
        return None
    event = _ERROR_EVENT.search(events)
    return None if event is None else _error_of(event.group(1), None)


def answer_error(status: int, body: bytes) -> WorkerError:
    """A whole error answer: its status, and the code its OpenAI-style body gives."""
    return WorkerError(status, _error_of(body, status).code)


def _error_of(doc: bytes, status: int | None) -> WorkerError:
    fallback = WorkerError(status or 500)
    try:
        error = json.loads(doc).get("error")
    except (ValueError, AttributeError, RecursionError):
        return fallback
    if not isinstance(error, dict):
        return fallback
    code = error.get("code")
    if isinstance(code, str):
        return WorkerError(status or TYPE_STATUS.get(error.get("type"), 500), code)
    if status is None and isinstance(code, int) and not isinstance(code, bool):
        return WorkerError(code if 400 <= code < 600 else 500)
    return WorkerError(status or TYPE_STATUS.get(error.get("type"), 500))
