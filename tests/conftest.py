"""Shared fixtures: tiny models of every architecture, made once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """`make(arch="llama", seed=0, tokenizer="bpe") -> Path`: a tiny HF-format model, cached for
    the session."""
    made: dict[tuple[str, int, str], Path] = {}

    def make(arch: str = "llama", seed: int = 0, tokenizer: str = "bpe") -> Path:
        key = (arch, seed, tokenizer)
        if key not in made:
            from radixpool.worker.tiny_model import make_tiny_model

            made[key] = make_tiny_model(
                tmp_path_factory.mktemp(f"tiny-{arch}-{seed}-{tokenizer}"), arch, seed, tokenizer)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory) -> Path:
    """The default tiny model (llama, seed 0)."""
    return tiny_model_factory("llama", 0)
