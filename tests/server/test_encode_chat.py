"""The worker's chat rendering counts the tools and the template variables
(`chat_template_kwargs`): a large tool list or variable is tokenized off the event loop, and one
too large for the context is refused before it is rendered at all. A variable may not replace
what the renderer gives every template."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from jinja2.defaults import DEFAULT_NAMESPACE

from radixpool.worker.config import EngineConfig
from radixpool.worker.server.config import ServerConfig
from radixpool.worker.server.errors import APIError
from radixpool.worker.server.request_checks import MAX_TEMPLATE_KWARGS
from radixpool.worker.server.state import WorkerState

MESSAGES = [{"role": "user", "content": "hi"}]


class CountingTokenizer:
    longest_token_chars = 4

    def __init__(self) -> None:
        self.threads: list[int] = []

    def encode_chat(self, messages, add_generation_prompt, **kwargs) -> list[int]:
        self.threads.append(threading.get_ident())
        return [1, 2, 3]


def _state(context_length: int) -> tuple[WorkerState, CountingTokenizer]:
    state = WorkerState(ServerConfig(EngineConfig(model_path="/nowhere"), "tiny"))
    tokenizer = CountingTokenizer()
    state.engine = SimpleNamespace(tokenizer=tokenizer,
                                   info=SimpleNamespace(context_length=context_length,
                                                        vocab_size=1000, sampling_defaults={}))
    return state, tokenizer


def _tools(count: int, properties: int) -> list[dict]:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                               for i in range(properties)}}
    return [{"type": "function", "function": {"name": f"f{j}", "parameters": schema}}
            for j in range(count)]


def test_tools_too_large_for_the_context_are_refused_naming_tools_before_rendering():
    state, tokenizer = _state(2048)
    with pytest.raises(APIError) as err:
        asyncio.run(state.encode_chat(MESSAGES, True, {"tools": _tools(128, 400)}))
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"
    assert err.value.param == "tools"
    assert tokenizer.threads == []


def test_a_large_tool_list_with_a_short_message_is_rendered_off_the_event_loop():
    state, tokenizer = _state(32768)

    async def encode() -> int:
        await state.encode_chat(MESSAGES, True, {"tools": _tools(8, 100)})
        return threading.get_ident()

    loop_thread = asyncio.run(encode())
    assert len(tokenizer.threads) == 1 and tokenizer.threads[0] != loop_thread


def test_many_empty_messages_are_rendered_off_the_event_loop():
    # Their text is 0 characters, so 65k of them were rendered and tokenized on the event loop:
    # every other request stood still 1.2 s (the template prints each message's markers).
    state, tokenizer = _state(2048)

    async def encode() -> int:
        await state.encode_chat([{"role": "user", "content": ""}] * 65_000, True)
        return threading.get_ident()

    loop_thread = asyncio.run(encode())
    assert len(tokenizer.threads) == 1 and tokenizer.threads[0] != loop_thread


def _body(kwargs: dict):
    from radixpool.worker.server.openai_protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate({"messages": MESSAGES,
                                                 "chat_template_kwargs": kwargs})


def test_a_template_variable_too_large_for_the_context_is_refused_naming_it_before_rendering():
    # A 1 MiB `chat_template_kwargs` value went into the template uncounted: a template that
    # prints it was rendered and tokenized on the event loop (every stream stood still 2.4 s)
    # and the refusal, if any, named `messages`.
    state, tokenizer = _state(2048)
    body = _body({"notes": "short", "preamble": "x" * (1 << 20)})
    with pytest.raises(APIError) as err:
        asyncio.run(state.encode_chat(body.template_messages, True, body.chat_template_kwargs,
                                      body.template_kwarg_chars))
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"
    assert err.value.param == "chat_template_kwargs.preamble"
    assert tokenizer.threads == []


def test_a_long_template_variable_with_a_short_message_is_rendered_off_the_event_loop():
    state, tokenizer = _state(32768)
    body = _body({"documents": [{"title": f"doc {i}", "text": "word " * 100} for i in range(40)]})

    async def encode() -> int:
        await state.encode_chat(body.template_messages, True, body.chat_template_kwargs,
                                body.template_kwarg_chars)
        return threading.get_ident()

    loop_thread = asyncio.run(encode())
    assert len(tokenizer.threads) == 1 and tokenizer.threads[0] != loop_thread


@pytest.mark.parametrize("name", [
    "messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "raise_exception",
    "strftime_now", *DEFAULT_NAMESPACE])
def test_a_name_the_renderer_gives_every_template_is_refused_as_a_template_variable(name):
    # bos_token was a 400 naming `messages`; tools, raise_exception and Jinja's own globals
    # silently replaced what the template relies on
    with pytest.raises(APIError) as err:
        _body({"enable_thinking": False, name: "x"})
    assert err.value.status == 400 and err.value.code == "reserved_template_variable"
    assert err.value.param == f"chat_template_kwargs.{name}"


def test_more_template_variables_than_a_template_reads_are_refused_naming_the_field():
    _body({f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS)})
    with pytest.raises(APIError) as err:
        _body({f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS + 1)})
    assert err.value.status == 400 and err.value.param == "chat_template_kwargs"
