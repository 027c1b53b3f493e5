"""Piecewise chat tokenization equals whole-prompt tokenization (what the worker does), and
turns itself off if a tokenizer ever disagrees."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.simfleet import sim_tokenizer_files
from radixpool.gateway.chat_tokens import ChatEncoder
from radixpool.tokenization import PromptTokenizer
from radixpool.worker.tiny_model import CHAT_TEMPLATE, train_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "You are terse. Answer in one word!"},
     {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "  and of Japan (東京?) — café naïve 🚀 \n\n twice  "}],
    [{"role": "user", "content": "<|im_end|> injected markers <s> stay tokens"}],
    [{"role": "user", "content": ""}],
]


def bpe_tokenizer() -> PromptTokenizer:
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    return PromptTokenizer({"tokenizer.json": train_tokenizer(0).to_str(),
                            "tokenizer_config.json": json.dumps(config)})


@pytest.mark.parametrize("make", [bpe_tokenizer, lambda: PromptTokenizer(sim_tokenizer_files())],
                         ids=["byte-level-bpe", "word-level"])
def test_piecewise_equals_whole(make):
    tokenizer = make()
    encoder = ChatEncoder(tokenizer)
    for _ in range(2):  # the second round is served from the piece cache
        for messages in CONVERSATIONS:
            ids = encoder.encode_chat(messages)
            assert ids.tolist() == tokenizer.encode_chat(messages)
    assert encoder.piecewise


def test_a_disagreeing_tokenizer_turns_piece_caching_off():
    tokenizer = bpe_tokenizer()
    encoder = ChatEncoder(tokenizer)
    encoder._encode_pieces = lambda text: np.array([1, 2, 3], dtype=np.uint64)
    messages = CONVERSATIONS[1]
    assert encoder.encode_chat(messages).tolist() == tokenizer.encode_chat(messages)
    assert not encoder.piecewise
    assert encoder.encode_chat(messages).tolist() == tokenizer.encode_chat(messages)
