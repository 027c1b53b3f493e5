"""The CPU example pool (examples/inferencepool-cpu.yaml) fits its worker's memory limit: the
weights, the KV pool it asks for and what a full step and a full batch add, as the worker's memory
plan counts them, with room for the runtime. Its KV pool alone once asked for more than the
limit (32,768 tokens of Qwen3-0.6B in float32: 7 GiB, and 9.6 GiB of resident memory at start,
against 6Gi), so the pod was killed at every start."""

from __future__ import annotations

from pathlib import Path

import yaml

from radixpool.worker.mem.memory_plan import GIB, ModelShape, PerRequestMemory, StepMemory
from radixpool.worker.model.reference_configs import REFERENCE_CONFIGS

REPO = Path(__file__).resolve().parents[2]
RUNTIME_BYTES = 1 * GIB   # Python, torch, tokenizer, the HTTP process (measured: under 0.7 GiB)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
BINARY_SUFFIXES = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def quantity_bytes(text: str) -> int:
    for suffix, scale in BINARY_SUFFIXES.items():
        if text.endswith(suffix):
            return int(float(text[:-len(suffix)]) * scale)
    return int(text)


def test_cpu_example_fits_its_memory_limit():
    pool = yaml.safe_load((REPO / "examples/inferencepool-cpu.yaml").read_text())
    assert pool["spec"]["model"]["uri"] == "hf://Qwen/Qwen3-0.6B", "the shape below is Qwen3-0.6B's"
    engine = pool["spec"]["engine"]
    config = REFERENCE_CONFIGS["qwen3-0.6b"]
    heads, kv_heads, head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                                 config["head_dim"])
    itemsize = ITEMSIZE[engine["dtype"]]
    shape = ModelShape(config["vocab_size"], config["hidden_size"], config["intermediate_size"],
                       config["num_hidden_layers"], heads * head_dim, kv_heads * head_dim,
                       config["tie_word_embeddings"], itemsize)
    kv_bytes = engine["kvCacheTokens"] * 2 * config["num_hidden_layers"] * kv_heads * head_dim \
        * itemsize
    batch = engine.get("maxRunningRequests", 256)
    step = StepMemory(shape, max_step_tokens=8192, max_batch=batch, graph_batch=0,
                      graph_kv_pages=0)
    per_request = PerRequestMemory(batch, config["max_position_embeddings"],
                                   config["vocab_size"], penalty_rows=batch, max_batch=batch)
    needed = (shape.weight_bytes + kv_bytes + step.activation_bytes + per_request.total_bytes
              + RUNTIME_BYTES)
    limit = quantity_bytes(engine["resources"]["memory"])
    assert needed <= limit, (f"the CPU example's worker needs about {needed / GIB:.1f} GiB "
                             f"(KV pool {kv_bytes / GIB:.1f} GiB), its limit is "
                             f"{limit / GIB:.1f} GiB")
