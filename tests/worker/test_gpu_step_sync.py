"""On a GPU: a steady decode step of the overlapped loop waits for the device once, when it reads
the previous step's tokens. Building the next step's inputs (batch tensors, KV slots, page
tables, sampling parameters) queues host-to-device copies and never waits, so the host schedules
step N+1 while the device still runs step N. `torch.cuda.set_sync_debug_mode("warn")` reports
every synchronizing call.

Skipped without CUDA (these machines have none).
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from radixpool.worker.config import EngineConfig
from radixpool.worker.engine_core import EngineCore
from radixpool.worker.messages import GenerateRequest
from radixpool.worker.model.reference_configs import write_reference_config
from radixpool.worker.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (none on this machine)")
SMALL = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=4096,
             max_position_embeddings=4096)


def synchronizing_calls(core: EngineCore) -> list[str]:
    """Where one `core.step()` synchronized with the device."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            core.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_decode_step_waits_for_the_device_once(tmp_path, backend, page_size):
    if backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer-python is not installed")
    path = write_reference_config(tmp_path, "qwen3-0.6b", **SMALL)
    core = EngineCore(EngineConfig(str(path), device="cuda", random_weights=True,
                                   attention_backend=backend, page_size=page_size,
                                   max_running_requests=8, kv_cache_tokens=8192))
    assert core.overlap
    greedy = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=64, temperature=0.8, top_k=20, top_p=0.9,
                             ignore_eos=True)
    for i in range(4):
        ids = [(7 * i + 3 * j) % 4000 + 10 for j in range(40 + 9 * i)]
        core.add_request(GenerateRequest(f"r{i}", ids, greedy if i % 2 else sampled, seed=i))
    for _ in range(4):   # prefill, then decode steps with every request running
        core.step()
    torch.cuda.set_sync_debug_mode("warn")   # its first use syncs once, outside any step
    torch.cuda.set_sync_debug_mode("default")
    per_step = [synchronizing_calls(core) for _ in range(12)]
    assert all(len(calls) <= 1 for calls in per_step), per_step
