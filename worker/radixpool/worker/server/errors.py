"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`.

Every rejection says what was wrong and where (`param` is a field path such as
`messages[0].content`), so a client can act on it. Bad input is never a 500.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from radixpool.http_edge import error_type
from radixpool.json_depth import too_deep

log = logging.getLogger("radixpool.worker.server")
_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)
        self.headers = headers

    def __reduce__(self) -> tuple:   # whole across processes (the body-parsing children)
        return _api_error, (self.status, self.message, self.param, self.code, self.type,
                            self.headers)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _api_error(status: int, message: str, param: str | None, code: str | None, type: str,
               headers: dict[str, str] | None) -> APIError:
    return APIError(status, message, param=param, code=code, type=type, headers=headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def stream_error(exc: Exception) -> dict:
    """The event that ends a stream whose generation failed after its 200. An `APIError` keeps
    its type and code: the engine refused the request mid-way (its grammar could not go on:
    `invalid_request_error`, the client's doing) or its core died (`service_unavailable`).
    Anything else is the worker's own `server_error`. A gateway counts only the worker's own
    failures against it (`gateway/radixpool/gateway/stream_errors.py`)."""
    if isinstance(exc, APIError):
        return error_body(f"generation failed: {exc.message}", exc.type, exc.param, exc.code)
    return error_body(f"generation failed: {exc}", "server_error")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unknown_field(param: str | None) -> APIError:
    return bad_request(f"unrecognized request argument '{param}'", param=param,
                       code="unknown_field")


def unavailable(message: str, retry_after_s: int = 5, code: str | None = None) -> APIError:
    return APIError(503, message, code=code, headers={"Retry-After": str(retry_after_s)})


def field_path(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """`("body", "messages", 0, "content")` → `messages[0].content`."""
    path = ""
    for part in loc:
        if part in ("body", "query", "path") and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or None


def nested_too_deep(body: bytes) -> APIError | None:
    """The error naming the field where a body the parser found too deep passes
    `json_depth.MAX_DEPTH` levels, as the gateway words it; None when the scan cannot tell."""
    found = too_deep(body.decode("utf-8", errors="replace"))
    if found is None:
        return None
    return bad_request(found.message(), param=found.param, code="invalid_json")


def lone_surrogate(body: bytes) -> APIError | None:
    """The error naming the first string that holds a lone UTF-16 surrogate (`"\\ud800"` in the
    JSON: valid JSON syntax, but no Unicode text), as the gateway words it; None when `body`
    has none. For bodies the strict parser refused: Python's `json` accepts such escapes."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):   # (nesting deeper than Python's stack)
        return None
    stack: list[tuple[Any, tuple[Any, ...]]] = [(doc, ())]
    while stack:
        value, loc = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                param = field_path(loc)
                return bad_request(f"'{param}' is not valid Unicode text: it holds a lone "
                                   "UTF-16 surrogate", param=param)
        elif isinstance(value, dict):
            stack.extend((v, (*loc, k)) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((v, (*loc, i)) for i, v in reversed(list(enumerate(value))))
    return None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_FORMS = {
    "str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
    "list[str]": "a list of strings",
    "list[constrained-str]": "a list of non-empty strings",
    "list[constrained-int]": "a list of token ids",
    "list[list[constrained-int]]": "a list of token-id lists",
    "list[TextPart]": 'a list of {"type": "text", "text": ...} parts',
}


def _union_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in _FORMS or "[" in part or "-" in part)


def _union_error(errors: list[dict], loc: tuple[Any, ...]) -> APIError:
    """Pydantic reports one error per union branch; answer with the forms the field accepts."""
    cut = next(i for i, part in enumerate(loc) if _union_tag(part))
    prefix, param = loc[:cut], field_path(loc[:cut])
    forms, detail, best = [], None, None
    for err in errors:
        eloc = tuple(err.get("loc", ()))
        if eloc[:cut] != prefix or len(eloc) <= cut:
            continue
        form = _FORMS.get(eloc[cut], str(eloc[cut]))
        if form not in forms:
            forms.append(form)
        nested, mismatch = eloc[cut + 1:], str(err.get("type", "")).endswith("_type")
        if nested:
            inner = eloc[:cut] + tuple(p for p in nested if not _union_tag(p))
            found = f"{field_path(inner)}: {err.get('msg')}"
        elif not mismatch:
            # the value has this form but breaks its limit (17 stop strings where 16 are taken)
            found = f"{param}: {err.get('msg')}"
        else:
            continue
        # A branch whose type held where it broke, furthest into the value, is the form the
        # client sent: token ids with one negative id are not "prompt[0]: a valid string".
        # Between type mismatches the first stands (their words differ between pydantic's JSON
        # and Python modes: "a valid array" / "a valid list").
        reach = (not mismatch, tuple(p for p in nested if isinstance(p, int)) if not mismatch
                 else ())
        if best is None or reach > best:
            best, detail = reach, found
    message = f"invalid value for '{param}': expected {' or '.join(forms)}"
    if detail:
        message += f" ({detail})"
    return bad_request(message, param=param)


def validation_error(exc: RequestValidationError) -> APIError:
    errors = list(exc.errors())
    err = errors[0]
    if any(_union_tag(part) for part in err.get("loc", ())):
        return _union_error(errors, tuple(err["loc"]))
    if err.get("type") == "json_invalid":
        detail = err.get("ctx", {}).get("error", "")
        return bad_request(f"request body is not valid JSON: {detail}".rstrip(": "),
                           code="invalid_json")
    loc = tuple(err.get("loc", ()))
    param = field_path(loc)
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "missing":
        return bad_request(f"'{param}' is required", param=param, code="missing_field")
    if err.get("type") == "extra_forbidden":
        return unknown_field(param)
    if param is None:
        return bad_request(f"invalid request body: {message}")
    if "input" in err and err.get("type") != "model_attributes_type":
        message = f"{message} (got {_short(err['input'])})"
    return bad_request(f"invalid value for '{param}': {message}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed",
                413: "request_too_large"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code,
                        headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # %r: the path is percent-decoded, and a CR or LF in it would forge log lines
        log.exception("unhandled error on %s %r", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
