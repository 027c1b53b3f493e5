"""The worker's chat rendering counts the tools: a large tool list is tokenized off the event
loop, and one too large for the context is refused before it is rendered at all."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from radixpool.worker.config import EngineConfig
from radixpool.worker.server.config import ServerConfig
from radixpool.worker.server.errors import APIError
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
                                   info=SimpleNamespace(context_length=context_length))
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
