"""The KV-event stream: `GET /kv_events?since=SEQ` (long poll) and `GET /kv_events/snapshot`.

Events are the radix cache's changes in block-hash terms (`radixpool.protocol.kv_blocks`). A
client that asks for events the worker's bounded log has already dropped, or for a sequence
number this worker never reached (it restarted or flushed), gets 409 `resync_required` and
starts again from a snapshot. The log lives in the engine front end, so serving it never
touches the engine core.

A reader that passes `queued=1` also gets a `queued` event for each request the worker queues,
naming its prompt's whole blocks before its prefill computes them: every gateway then knows where
another one sent a prompt within a step, not only when its prefill ends. Others never see them
(their `next` still passes them).

Every answer also says the worker's load, `{"requests": N}` (sequences submitted and not
finished). A reader that passes `load=` (the N it last saw) is also answered, with or without
events, once N differs from it (`kv_event_log.LOAD_LINGER_S` later): every gateway following the
stream sees the requests the other gateways sent, within about 10 ms.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from radixpool.protocol.kv_blocks import to_hex
from radixpool.worker.server.errors import APIError
from radixpool.worker.server.state import WorkerState

MAX_WAIT_S = 60.0
MAX_EVENTS = 10_000


def _resync(since: int, last: int) -> APIError:
    return APIError(409, f"events after seq {since} are no longer available (latest is {last}); "
                         "fetch GET /kv_events/snapshot and resume from its seq",
                    param="since", code="resync_required")


def router(state: WorkerState) -> APIRouter:
    r = APIRouter()

    @r.get("/kv_events")
    async def kv_events(
        since: Annotated[int, Query(ge=0, description="return events with seq > since")] = 0,
        timeout: Annotated[float, Query(ge=0, le=MAX_WAIT_S,
                                        description="seconds to wait when there are none")] = 10,
        limit: Annotated[int, Query(ge=1, le=MAX_EVENTS)] = MAX_EVENTS,
        load: Annotated[int | None, Query(ge=0, description=(
            "the load (requests) this reader last saw: also answer once it differs"))] = None,
        queued: Annotated[bool, Query(description=(
            "also return `queued` events: a request's prompt blocks, before its prefill"
        ))] = False,
    ) -> dict:
        engine = state.engine
        log = engine.kv_events
        if since > log.last_seq:
            raise _resync(since, log.last_seq)
        events = log.events_since(since)
        if events is not None and not events and timeout > 0:
            await state.lifecycle.until_stopping(
                log.wait(since, timeout, lambda: engine.live_requests, load))
            events = log.events_since(since)
        if events is None:
            raise _resync(since, log.last_seq)
        events = events[:limit]
        shown = events if queued else [e for e in events if e.type != "queued"]
        return {
            "instance_id": engine.instance_id,
            "events": [event.to_json() for event in shown],
            "next": events[-1].seq if events else since,
            "load": {"requests": engine.live_requests},
        }

    @r.get("/kv_events/snapshot")
    async def kv_snapshot() -> dict:
        seq, blocks = await state.engine.kv_snapshot_async()
        return {"instance_id": state.engine.instance_id, "seq": seq, "blocks": to_hex(blocks)}

    return r
