"""The generation endpoints served straight from ASGI, without FastAPI's per-request layers.

FastAPI declares every route (so the OpenAPI schema, which clients and the fuzz tests read, is
complete), but a request passing through it meets a dozen layers — middleware, routing,
dependency resolution, body re-validation — before its handler runs: about 0.15 ms per request on
a 2-vCPU machine, a large share of what the worker itself adds to a request. `FastRoutes` serves
`POST` to the generation paths directly: read the body, validate it with the route's own pydantic
model, call the route's own handler, send the response it returns. Errors take the same
OpenAI-style shape as the app's exception handlers give them. Every other request goes to the app.

Bodies over `INLINE_BODY_BYTES` are validated in child processes (`radixpool.child_pool`): the
validation holds the GIL for as long as it takes, and a body of millions of tiny values (a batch
of one-id prompts, a million chat messages) would otherwise stall every stream on this event loop
for seconds. What comes back is unpickled on the loop's side with the GIL held, so the body
models refuse in the child what the handler would refuse anyway for its size (`request_checks`):
a million prompts come back as one error, not as a million lists, and 65k chat messages too
long for the context as one error, not as 65k dicts. A body that needs more than
`BODY_MEMORY_BYTES` to validate gets 413. A body whose objects hold more than
`json_members.MAX_OBJECT_MEMBERS` keys in all is refused (400) before validation: a million
unknown keys made a million validation errors, and held a child for its 30 s limit.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, get_type_hints

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from radixpool.child_pool import ChildPool, TooBig
from radixpool.json_members import over_member_bound, too_many_members_message
from radixpool.worker.server.errors import (
    APIError,
    bad_request,
    lone_surrogate,
    nested_too_deep,
    unknown_field,
    validation_error,
)
from radixpool.worker.server.request_checks import Served

log = logging.getLogger("radixpool.worker.server")
MAX_BODY_BYTES = 64 << 20   # a prompt at any context length fits many times over
INLINE_BODY_BYTES = 256 << 10   # about 64k tokens of text: a few ms to validate in place
BODY_PROCESSES = 2
BODY_MEMORY_BYTES = 1 << 30     # what one child may grow by to validate a body
# where `validated` and the body models live, imported by each child before its memory limit
BODY_MODULES = ("radixpool.worker.server.fast_path", "radixpool.worker.server.openai_protocol",
                "radixpool.worker.server.native_api")

Endpoint = Callable[..., Awaitable[Any]]


def post_routes(routers: list[APIRouter],
                paths: frozenset[str]) -> dict[str, tuple[type[BaseModel], Endpoint]]:
    """Each path's body model and handler, as declared to FastAPI (`body: Model, request`)."""
    found = {}
    for route in (route for router in routers for route in router.routes):
        if isinstance(route, APIRoute) and route.path in paths and "POST" in route.methods:
            found[route.path] = (get_type_hints(route.endpoint)["body"], route.endpoint)
    missing = paths - found.keys()
    if missing:
        raise ValueError(f"no POST route declared for {sorted(missing)}")
    return found


class FastRoutes:
    def __init__(self, app: FastAPI, routers: list[APIRouter], paths: frozenset[str],
                 children: ChildPool,
                 served: Callable[[], Served]) -> None:
        self.app = app
        self.routes = post_routes(routers, paths)
        self.children = children
        self.served = served

    async def __call__(self, scope, receive, send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        model, endpoint = route
        try:
            body = await _read_body(receive)
            parsed = await self._validate(model, body)
            response = await endpoint(body=parsed, request=Request(scope, receive))
        except APIError as exc:
            response = exc.response()
        except Exception as exc:
            log.exception("unhandled error on POST %s", scope["path"])
            response = APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
        if not callable(response):
            response = JSONResponse(response)
        await response(scope, receive, send)

    async def _validate(self, model: type[BaseModel], body: bytes) -> BaseModel:
        served = self.served()
        if len(body) <= INLINE_BODY_BYTES:
            return validated(model, body, served)
        try:
            return await self.children.run(validated, model, body, served)
        except TooBig as exc:
            raise APIError(413, f"request body could not be validated within this worker's {exc}",
                           code="request_too_large") from None


def validated(model: type[BaseModel], body: bytes, served: Served | None = None) -> BaseModel:
    """The body as `model`, or the APIError FastAPI's own validation would give, or the
    refusal the model's validators make for this worker (`request_checks`). A body past the
    member bound is refused before validation (`radixpool.json_members`)."""
    doc = over_member_bound(body)
    if doc is not None:
        raise _past_member_bound(model, doc)
    try:
        return model.model_validate_json(body, context=served)
    except ValidationError as exc:   # the same locations FastAPI would report
        errors = exc.errors()
        if errors[0]["type"] == "json_invalid":
            detail = str(errors[0].get("ctx"))
            error = None
            if "escape" in detail:   # pydantic's word for a lone surrogate: only then parse again
                error = lone_surrogate(body)
            elif "recursion limit" in detail:
                error = nested_too_deep(body)
            if error is not None:
                raise error from None
        raise validation_error(RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in errors])) from None


def _past_member_bound(model: type[BaseModel], doc: Any) -> APIError:
    """Named by the body's first unknown field when it has one, as a smaller body would be."""
    if isinstance(doc, dict) and model.model_config.get("extra") == "forbid":
        known = {field.alias or name for name, field in model.model_fields.items()}
        unknown = next((key for key in doc if key not in known), None)
        if unknown is not None:
            return unknown_field(unknown)
    return bad_request(too_many_members_message(), code="too_many_members")


async def _read_body(receive) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(499, "client closed the request", code="client_disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"request body is over {MAX_BODY_BYTES >> 20} MiB",
                           code="request_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
