"""The route key: token-exact (the same block hashes the worker announces) or text fallback,
and 400s that name the field for bodies the gateway cannot route."""

from __future__ import annotations

import pytest

from bench.simfleet import SimKV, sim_tokenizer_files
from radixpool.gateway.route_key import BadRequest, KeyBuilder
from radixpool.tokenization import PromptTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return PromptTokenizer(sim_tokenizer_files())


def test_chat_key_is_the_workers_own_block_hashes(tokenizer):
    keys = KeyBuilder(64, 256)
    keys.use_tokenizer(tokenizer, 16)
    messages = [{"role": "system", "content": " ".join(f"w{i}" for i in range(100))},
                {"role": "user", "content": "w7 w8 w9"}]
    key = keys.build("/v1/chat/completions", {"messages": messages, "cache_salt": "t1"})
    worker_cache = SimKV(10_000, 16)
    ids = tokenizer.encode_chat(messages)
    assert key.exact and key.units == len(ids)
    assert key.hashes == worker_cache.hashes(ids, "t1")
    same_ids = keys.build("/generate", {"input_ids": ids, "cache_salt": "t1"})
    assert same_ids.hashes == key.hashes


def test_without_tokenizer_routing_falls_back_to_text_bytes():
    keys = KeyBuilder(8, 256)
    a = keys.build("/v1/completions", {"prompt": "x" * 40 + "tail one"})
    b = keys.build("/v1/completions", {"prompt": "x" * 40 + "tail two"})
    assert not a.exact and a.units == 48
    assert a.hashes[:5] == b.hashes[:5] and a.hashes[5] != b.hashes[5]
    chat = keys.build("/v1/chat/completions",
                      {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert chat.units > 0


@pytest.mark.parametrize("path,body,message", [
    ("/v1/chat/completions", [], "JSON object"),
    ("/v1/chat/completions", {"messages": []}, "'messages'"),
    ("/v1/chat/completions", {"messages": ["hi"]}, r"messages\[0\]"),
    ("/v1/completions", {}, "'prompt' is required"),
    ("/v1/completions", {"prompt": 5}, "'prompt'"),
    ("/generate", {}, "'text' or 'input_ids'"),
    ("/generate", {"input_ids": ["a"]}, "integer token ids"),
    ("/generate", {"text": "x", "cache_salt": 3}, "'cache_salt'"),
    ("/generate", {"text": "x", "model": 3}, "'model'"),
])
def test_unroutable_bodies_are_rejected_with_the_field_named(path, body, message):
    with pytest.raises(BadRequest, match=message):
        KeyBuilder(64, 256).build(path, body)


@pytest.mark.parametrize("path,body,param,code", [
    ("/v1/chat/completions", {}, "messages", "missing_field"),
    ("/v1/chat/completions", {"messages": None}, "messages", None),   # present: not missing
    ("/v1/completions", {"prompt": [[]]}, "prompt", None),
    ("/v1/completions", {"prompt": [[], [5]]}, "prompt[0]", None),
    ("/v1/completions", {"prompt": ["w1 \udc80"]}, "prompt[0]", None),
    ("/generate", {"input_ids": [[], [5]]}, "input_ids[0]", None),
    ("/generate", {"text": ["w1 \udc80", "w2"]}, "text[0]", None),
])
def test_refusals_name_the_param_and_code_a_worker_names(tokenizer, path, body, param, code):
    """The SDK exposes `param` and `code`: the gateway's own refusal of a body must name what a
    worker names for it (it named `prompt` for the first prompt of a batch, and called a
    `messages: null` a missing field)."""
    keys = KeyBuilder(64, 256)
    keys.use_tokenizer(tokenizer, 16)
    with pytest.raises(BadRequest) as refused:
        keys.build(path, body)
    assert (refused.value.param, refused.value.code) == (param, code)


def test_tool_requests_key_on_the_tokens_the_worker_renders(tiny_model):
    """Agent loops resend the same tools every turn: the gateway renders them (and the calls and
    tool results in the history) exactly as the worker does, whatever key order or explicit nulls
    the client sent, so the key is token-exact."""
    import asyncio

    from radixpool.worker.server.openai_protocol import ChatCompletionRequest
    from radixpool.worker.server.tool_use import ToolUse

    tokenizer = PromptTokenizer.from_dir(tiny_model)   # its template renders tools
    keys = KeyBuilder(64, 256)
    keys.use_tokenizer(tokenizer, 16)
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    tools = [{"function": {"parameters": schema, "description": None, "name": "search"},
              "type": "function"}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "search", "arguments": '{"q": "radix"}'}}
    messages = [{"role": "system", "content": "agent"}, {"role": "user", "content": "find it"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "found"}]
    doc = {"messages": messages, "tools": tools}
    key = keys.build("/v1/chat/completions", doc)

    body = ChatCompletionRequest.model_validate(doc)
    worker_messages = [m.template_dict() for m in body.messages]
    tool_use = asyncio.run(ToolUse.of(body, worker_messages))
    worker_ids = tokenizer.encode_chat(worker_messages, tools=tool_use.rendered)
    assert key.exact and key.units == len(worker_ids)
    assert key.hashes == SimKV(10_000, 16).hashes(worker_ids, None)
    plain = keys.build("/v1/chat/completions", {"messages": messages[:2]})
    assert plain.units < key.units   # the tools are in the prompt, not dropped


@pytest.mark.parametrize("namespace", [None, "tenant-a"])
def test_short_prompt_hashes_equal_the_vectorised_ones_the_worker_announces(namespace):
    # the gateway hashes short prompts with plain integers, the worker with numpy: the values
    # must be the same on either side of the switch, for ids, arrays and bytes alike
    import random

    import numpy as np

    from radixpool.protocol.kv_blocks import (
        SMALL_PROMPT_BLOCKS,
        prefix_block_hash_list,
        prefix_block_hashes,
    )

    rng = random.Random(7)
    for block in (1, 4, 16, 64):
        for n in {0, 1, block - 1, block, 3 * block + 1, SMALL_PROMPT_BLOCKS * block,
                  (SMALL_PROMPT_BLOCKS + 1) * block + 3}:
            ids = [rng.randrange(1 << 31) for _ in range(n)]
            want = prefix_block_hashes(ids, block, namespace).tolist()
            assert prefix_block_hash_list(ids, block, namespace) == want
            assert prefix_block_hash_list(np.array(ids, dtype=np.uint64), block, namespace) == want
            data = bytes(rng.randrange(256) for _ in range(n))
            assert prefix_block_hash_list(data, block, namespace) == prefix_block_hashes(
                np.frombuffer(data, dtype=np.uint8).astype(np.uint64), block, namespace).tolist()


def test_the_gateways_fast_encode_gives_the_workers_ids(tokenizer):
    from radixpool.gateway.chat_tokens import encode_ids

    for text in ("", "w1 w2 w3", " ".join(f"w{i}" for i in range(300)), "w5 unknown-word w6"):
        for special in (True, False):
            assert encode_ids(tokenizer, text, special) == tokenizer.encode(text, special)
