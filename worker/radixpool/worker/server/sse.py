"""Server-sent events: `data: {json}\\n\\n` frames, and a response that notices disconnects.

`EventStream` always listens for `http.disconnect` next to the stream (Starlette only does that for
ASGI < 2.4). A client that goes away cancels the body iterator at once, even while the request is
still queued and nothing is being sent, so the engine request is aborted and its KV freed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One frame. A NaN or infinity raises (JSON has neither; `NaN` breaks a client's parser):
    the stream's error event says so instead."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return b"data: " + text.encode() + b"\n\n"


class EventStream(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                with contextlib.suppress(OSError):   # the client is gone
                    await self.stream_response(send)
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()
