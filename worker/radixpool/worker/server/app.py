"""The worker's ASGI app: routes, error handlers, `/metrics`, the generation fast path, behind the
lifecycle gate."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.responses import Response

from radixpool.worker.server import kv_events, native_api, openai_api
from radixpool.worker.server.errors import install_error_handlers
from radixpool.worker.server.fast_path import MAX_BODY_BYTES, FastRoutes
from radixpool.worker.server.lifecycle import GENERATION_PATHS, Gate
from radixpool.worker.server.state import WorkerState

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def create_app(state: WorkerState) -> Gate:
    app = FastAPI(
        title="RadixPool worker",
        version=state.version,
        description="OpenAI-compatible and native LLM serving with a radix-tree prefix KV cache.",
        max_body_size=MAX_BODY_BYTES,   # the routes off the fast path (`/prefix_probe`, ...)
    )
    app.state.worker = state
    install_error_handlers(app)
    routers = [openai_api.router(state), native_api.router(state), kv_events.router(state)]
    for router in routers:
        app.include_router(router)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type=PROMETHEUS_CONTENT_TYPE)

    fast = FastRoutes(app, routers, GENERATION_PATHS, state.bodies, lambda: state.served)
    return Gate(fast, state.lifecycle, state.config.api_key, state.config.control_api_key,
                MAX_BODY_BYTES)
