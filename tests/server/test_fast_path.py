"""The generation fast path answers exactly as the FastAPI routes it stands in for. In-process ASGI
calls, no engine: only requests that fail validation, which never reach the engine."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from radixpool.child_pool import ChildPool
from radixpool.worker.config import EngineConfig
from radixpool.worker.server import app as app_module
from radixpool.worker.server import fast_path
from radixpool.worker.server.app import create_app
from radixpool.worker.server.config import ServerConfig
from radixpool.worker.server.errors import APIError
from radixpool.worker.server.fast_path import FastRoutes
from radixpool.worker.server.openai_protocol import ChatCompletionRequest
from radixpool.worker.server.request_checks import Served
from radixpool.worker.server.state import WorkerState

MSG = [{"role": "user", "content": "hi"}]
INVALID = [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b"[]"),
    ("/v1/chat/completions", b"{}"),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
    ("/v1/chat/completions", {"messages": MSG, "temperature": "hot"}),
    ("/v1/chat/completions", {"messages": MSG, "n": 0}),
    ("/v1/chat/completions", {"messages": MSG, "bogus_field": 1}),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {"bos_token": "x"}}),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {
        f"k{i}": 0 for i in range(65)}}),
    ("/v1/completions", {"prompt": 7}),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}),
    ("/v1/completions", {"prompt": [[1], "x"]}),
    ("/generate", {"text": 5}),
    ("/generate", {"text": "x", "input_ids": [[1], 2]}),
]


@pytest.fixture(scope="module")
def gate():
    state = WorkerState(ServerConfig(EngineConfig(model_path="/nowhere"), "tiny"))
    yield create_app(state)
    state.bodies.close()


def call(app, path: str, body: bytes, chunk: int | None = None) -> tuple[int, dict]:
    parts = [body[i:i + chunk] for i in range(0, len(body), chunk)] if chunk else [body]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
                for i, p in enumerate(parts)]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    asyncio.run(app(scope, receive, send))
    body_out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body_out)


@pytest.mark.parametrize(("path", "body"), INVALID)
def test_fast_path_errors_equal_the_fastapi_routes(gate, path, body):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    fast = gate.app
    assert isinstance(fast, FastRoutes) and path in fast.routes
    status, doc = call(fast, path, raw, chunk=5)   # a body in several ASGI messages
    ref_status, ref_doc = call(fast.app, path, raw)   # the plain FastAPI app
    assert status == ref_status and 400 <= status < 500
    for key in ("param", "type", "code"):
        assert doc["error"][key] == ref_doc["error"][key], key
    assert doc["error"]["type"] == "invalid_request_error"
    if doc["error"]["param"] is not None:   # whole-body errors: pydantic's JSON and Python
        assert doc == ref_doc                 # modes word the detail apart



def test_a_body_over_the_limit_is_refused(gate, monkeypatch):
    monkeypatch.setattr(fast_path, "MAX_BODY_BYTES", 1024)
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 4096}]}).encode()
    status, doc = call(gate.app, "/v1/chat/completions", body, chunk=512)
    assert status == 413 and doc["error"]["code"] == "request_too_large"


def test_a_body_over_the_limit_is_refused_off_the_fast_path_too(monkeypatch):
    # /prefix_probe read any body whole: 100 MiB of text took 19 GiB and wedged the worker
    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 1024)
    gate = create_app(WorkerState(ServerConfig(EngineConfig(model_path="/nowhere"), "tiny")))
    for body in ({"text": "x" * 4096}, {"input_ids": [1] * 2048}):
        status, doc = call(gate.app, "/prefix_probe", json.dumps(body).encode(), chunk=512)
        assert status == 413 and doc["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(("path", "field"), [("/generate", "input_ids"),
                                             ("/v1/completions", "prompt")])
def test_one_bad_id_in_a_long_prompt_is_refused_as_fast_as_an_unknown_field(gate, path, field):
    # Every other branch of the prompt union used to report each of the prompt's items: 4M
    # errors (31 s, 4.6 GiB, with the event loop held) for a 4M-id prompt with one bad id.
    ids = [1] * 500_000

    def seconds_to_refuse(body: dict, param: str) -> float:
        raw = json.dumps(body).encode()
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            status, doc = call(gate.app, path, raw)
            best = min(best, time.perf_counter() - started)
            assert status == 400 and doc["error"]["param"] == param, doc
        return best

    bad_id = seconds_to_refuse({field: [*ids, -1]}, field)
    unknown = seconds_to_refuse({field: ids, "bogus_field": 1}, "bogus_field")
    assert bad_id < 10 * unknown, (bad_id, unknown)


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"input_ids": [[1]] * 100_000 + [[-1]]}),
    ("/v1/completions", {"prompt": "w " * 200_000, "temperature": "hot"}),
    ("/v1/chat/completions", {"messages": [*MSG * 20_000, {"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {
        f"k{i}": 0 for i in range(100_000)}}),
])
def test_a_large_body_validated_in_a_child_process_gets_the_same_answer(gate, path, body):
    raw = json.dumps(body).encode()
    assert len(raw) > fast_path.INLINE_BODY_BYTES
    with pytest.raises(APIError) as in_place:
        fast_path.validated(gate.app.routes[path][0], raw)
    status, doc = call(gate.app, path, raw)
    assert status == in_place.value.status == 400 and doc == in_place.value.body()


def test_a_chat_too_long_for_the_context_is_refused_where_its_body_is_validated():
    # 65k short messages came back from their validating child as 65k dicts, unpickled, checked
    # and summed on the event loop only to be refused there as too long.
    served = Served("tiny", "/nowhere", vocab_size=1000, context_length=2048, text_chars=98_304)
    raw = json.dumps({"messages": MSG * 65_000}).encode()
    with pytest.raises(APIError) as refused:
        fast_path.validated(ChatCompletionRequest, raw, served)
    error = refused.value.body()["error"]
    assert refused.value.status == 400 and error["code"] == "context_length_exceeded", error
    assert error["param"] == "messages" and error["message"].startswith(
        "the prompt is 130000 characters"), error


def test_a_body_too_big_to_validate_gets_413_and_the_next_one_is_answered():
    state = WorkerState(ServerConfig(EngineConfig(model_path="/nowhere"), "tiny"))
    # a tighter limit than the default; pydantic's Rust code may hang on the failed allocation
    # instead of aborting, which the timeout ends
    state.bodies = ChildPool(1, 16 << 20, fast_path.BODY_MODULES, timeout_s=10)
    gate = create_app(state)
    try:
        status, doc = call(gate.app, "/generate", json.dumps(
            {"input_ids": [[1]] * 1_000_000}).encode())   # 5 MiB: ~120 MiB once validated
        assert status == 413 and doc["error"]["code"] == "request_too_large"
        assert_large_bodies_still_validated(gate)
    finally:
        state.bodies.close()


def assert_large_bodies_still_validated(gate) -> None:
    """The validating child is free again: a large body (off the loop) gets its own 400."""
    status, doc = call(gate.app, "/v1/completions", json.dumps(
        {"prompt": "w " * 150_000, "temperature": "hot"}).encode())
    assert status == 400 and doc["error"]["param"] == "temperature"


def test_many_large_tool_schemas_are_checked_within_a_childs_time_limit():
    """128 tools of 400 properties each (1.2 MiB): the Python `jsonschema` meta-schema check
    took 20-30 s and held the validating child; now the last tool's bad schema is named."""
    state = WorkerState(ServerConfig(EngineConfig(model_path="/nowhere"), "tiny"))
    state.bodies = ChildPool(1, fast_path.BODY_MEMORY_BYTES, fast_path.BODY_MODULES,
                             timeout_s=10)
    gate = create_app(state)
    properties = {f"p{i}": {"type": "string"} for i in range(400)}
    tools = [{"type": "function", "function": {"name": f"f{j}", "parameters": {
        "type": "object", "properties": properties}}} for j in range(128)]
    tools[127]["function"]["parameters"] = {"type": "object", "properties": {
        **properties, "last": {"type": "strin"}}}
    try:
        status, doc = call(gate.app, "/v1/chat/completions", json.dumps(
            {"messages": MSG, "tools": tools}).encode())
        assert status == 400, doc
        assert doc["error"]["param"].startswith("tools[127].function.parameters")
        assert "properties/last/type" in doc["error"]["message"]
        assert_large_bodies_still_validated(gate)
    finally:
        state.bodies.close()


def test_template_variables_are_measured_in_the_validating_child():
    """A large `chat_template_kwargs` is measured where the body is validated, so the event
    loop adds numbers instead of serializing the document again."""
    state = WorkerState(ServerConfig(EngineConfig(model_path="/nowhere"), "tiny"))
    raw = json.dumps({"messages": MSG, "chat_template_kwargs": {
        "preamble": "é" * 300_000, "documents": [{"text": "x"}]}}).encode()
    assert len(raw) > fast_path.INLINE_BODY_BYTES
    try:
        body = asyncio.run(state.bodies.run(fast_path.validated, ChatCompletionRequest, raw))
    finally:
        state.bodies.close()
    assert body.template_kwarg_chars == {"preamble": 300_000, "documents": 14}   # [{"text":"x"}]


def test_only_post_to_the_generation_paths_takes_the_fast_path(gate):
    fast = gate.app
    assert set(fast.routes) == {"/v1/chat/completions", "/v1/completions", "/generate"}
    status, doc = call(fast, "/prefix_probe", b"{}")   # served by FastAPI, same error shape
    assert status == 400 and "error" in doc
