"""GPU memory sizing, checked on CPU where it is pure: the weight estimate against the real
configurations' parameter counts, the KV pool sized after activations and graphs, errors that
name what did not fit, bf16 by default on GPU, and a loader that streams the checkpoint (the host
never holds more than one of its tensors)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from radixpool.worker.attention.base import AttentionShape, create_backend
from radixpool.worker.config import EngineConfig
from radixpool.worker.mem.kv_pool import KVPool
from radixpool.worker.mem.memory_plan import (
    CPU_MEM_FRACTION,
    GIB,
    HostMemory,
    PerRequestMemory,
    StepMemory,
    check_kv_tokens_fit,
    check_weights_fit,
    host_memory,
    kv_tokens_for_memory,
)
from radixpool.worker.model import CausalLM, loader, model_spec
from radixpool.worker.model.reference_configs import REFERENCE_CONFIGS, write_reference_config
from radixpool.worker.model_runner import ModelRunner, model_shape, resolve_dtype


def reference(name: str, tmp_path):
    from transformers import AutoConfig

    return model_spec(AutoConfig.from_pretrained(write_reference_config(tmp_path / name, name)))


@pytest.mark.parametrize("name", REFERENCE_CONFIGS)
def test_weight_estimate_matches_the_real_parameter_count(name, tmp_path):
    spec = reference(name, tmp_path)
    backend = create_backend("torch", AttentionShape(spec.num_heads, spec.num_kv_heads,
                                                     spec.head_dim, 1.0), torch.device("cpu"))
    with torch.device("meta"):
        model = CausalLM(spec, backend)
    real = sum(p.numel() for p in model.parameters()) * 2   # bf16
    estimate = model_shape(spec, torch.bfloat16).weight_bytes
    assert estimate == pytest.approx(real, rel=1e-3)
    if name == "llama-3.1-8b":
        assert 14.9 * GIB < estimate < 15.0 * GIB   # 8.03 B parameters in bf16


def step_memory(spec, graph_batch: int, context: int = 8192) -> StepMemory:
    return StepMemory(model_shape(spec, torch.bfloat16), max_step_tokens=8192, max_batch=256,
                      graph_batch=graph_batch, graph_kv_pages=graph_batch * context)


def test_kv_is_sized_after_activations_and_graphs(tmp_path):
    spec = reference("llama-3.1-8b", tmp_path)
    per_token = KVPool.bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                       torch.bfloat16)
    per_request = PerRequestMemory(260, 8192, spec.vocab_size, 260, 256)
    free = 60 * GIB   # an 80 GB H100 after 15 GiB of weights
    plain = kv_tokens_for_memory(free, 0.85, per_token, per_request, 16)
    eager = kv_tokens_for_memory(free, 0.85, per_token, per_request, 16, step_memory(spec, 0))
    graphs = kv_tokens_for_memory(free, 0.85, per_token, per_request, 16, step_memory(spec, 256))
    assert graphs < eager < plain
    reserved = step_memory(spec, 256)
    assert (plain - graphs) * per_token == pytest.approx(
        reserved.activation_bytes + reserved.graph_bytes, abs=16 * per_token)
    assert 390_000 < graphs < 410_000   # ~49 GiB of KV at 128 KiB per token


def test_running_out_at_start_up_names_what_did_not_fit(tmp_path):
    spec = reference("llama-3.1-8b", tmp_path)
    per_request = PerRequestMemory(260, 131072, spec.vocab_size, 260, 256)
    with pytest.raises(ValueError) as err:
        kv_tokens_for_memory(2 * GIB, 0.85, 131072, per_request, 16,
                             step_memory(spec, 256, context=131072))
    message = str(err.value)
    for part in ("per-request tensors", "step activations", "decode CUDA graphs",
                 "--disable-cuda-graph", "GiB", "mem_fraction 0.85"):
        assert part in message
    with pytest.raises(MemoryError, match=r"weights \(14\.9\d GiB\) do not fit in the 10\.00 GiB"):
        check_weights_fit(model_shape(spec, torch.bfloat16).weight_bytes, 10 * GIB, "cuda:0")


def test_bf16_is_the_default_on_gpu_and_float32_on_cpu():
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32


def test_random_weights_need_only_a_config(tmp_path):
    path = write_reference_config(tmp_path / "q", "qwen3-0.6b", num_hidden_layers=2,
                                  hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=512)
    runner = ModelRunner(EngineConfig(str(path), device="cpu", random_weights=True,
                                      kv_cache_tokens=256, context_length=128))
    assert runner.architecture == "Qwen3ForCausalLM"
    weights = dict(runner.model.named_parameters())
    assert torch.all(weights["model.norm.weight"] == 1)
    assert 0.015 < weights["model.layers.0.mlp.down_proj.weight"].std() < 0.025


def test_loader_holds_one_checkpoint_tensor_at_a_time(tiny_model, monkeypatch):
    """Weights go from the file into their (device) parameters one tensor at a time: the host
    never holds a second full copy of the checkpoint."""
    alive: list[weakref.ref] = []
    most_alive = 0
    real_safe_open = loader.safe_open

    class Tracking:
        def __init__(self, *args, **kwargs):
            self.inner = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            nonlocal most_alive
            gc.collect()
            most_alive = max(most_alive, sum(r() is not None for r in alive) + 1)
            tensor = self.f.get_tensor(name)
            alive.append(weakref.ref(tensor))
            return tensor

    monkeypatch.setattr(loader, "safe_open", Tracking)
    runner = ModelRunner(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=256))
    assert len(alive) >= 10 and most_alive == 1
    assert runner.model.lm_head.weight.abs().sum() > 0


def test_a_kv_pool_given_outright_must_leave_room_for_a_step(tmp_path):
    """kv_cache_tokens taking the whole device let a worker start and then run out of memory at
    its first long prefill, losing every request in flight. It is refused at start, naming
    what a step needs and the largest pool that leaves room for it; a pool that fits passes."""
    spec = reference("llama-3.1-8b", tmp_path)
    per_token = KVPool.bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                       torch.bfloat16)
    per_request = PerRequestMemory(260, 8192, spec.vocab_size, 260, 256)
    step = step_memory(spec, 256)
    free = 60 * GIB
    whole = free // per_token   # every free byte as KV
    with pytest.raises(ValueError) as err:
        check_kv_tokens_fit(whole, free, per_token, per_request, 16, step)
    message = str(err.value)
    for part in (f"kv_cache_tokens {whole}", "step activations (max_prefill_tokens, max_running_",
                 "decode CUDA graphs", "60.00 GiB free", "or size the pool with mem_fraction"):
        assert part in message, part
    most = int(message.split("set kv_cache_tokens to at most ")[1].split(",")[0])
    assert most % 16 == 0 and most < whole
    check_kv_tokens_fit(most, free, per_token, per_request, 16, step)   # the advice fits
    with pytest.raises(ValueError):
        check_kv_tokens_fit(most + 16, free, per_token, per_request, 16, step)


def test_host_memory_is_the_containers_limit_less_its_anonymous_memory(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemAvailable:   32768000 kB\n")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{4 * GIB}\n")
    # page cache (file) is left out: the kernel reclaims it before the limit kills anything
    (v2 / "memory.stat").write_text(f"anon {GIB}\nfile {2 * GIB}\n")
    assert host_memory(str(v2), str(meminfo)) == HostMemory(3 * GIB,
                                                            "the container's memory limit")
    (v2 / "memory.max").write_text("max\n")   # no limit: the host's
    assert host_memory(str(v2), str(meminfo)) == HostMemory(32768000 * 1024,
                                                            "the host's available memory")
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory/memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    (v1 / "memory/memory.stat").write_text(f"rss {GIB}\ntotal_rss {GIB // 2}\n")
    assert host_memory(str(v1), str(meminfo)).free_bytes == 2 * GIB - GIB // 2
    (v1 / "memory/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert host_memory(str(v1), str(meminfo)).bound == "the host's available memory"
    assert host_memory(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_a_cpu_worker_in_a_small_container_sizes_its_kv_to_the_limit(tiny_model, monkeypatch):
    """On CPU the KV pool's pages are only touched as the cache fills: a pool larger than the
    container's memory limit started, and the worker was killed for memory once the cache
    grew (the default 2 GiB pool in a 1 GiB pod, or a kv_cache_tokens too large). The default
    now shrinks to fit, and a kv_cache_tokens that does not fit is refused at start."""
    import radixpool.worker.model_runner as model_runner

    roomy = ModelRunner(EngineConfig(str(tiny_model), device="cpu"))
    per_token = roomy.kv_pool.bytes_per_token(roomy.num_layers, roomy.num_kv_heads,
                                              roomy.head_dim, roomy.dtype)
    reserved = roomy.per_request.total_bytes + roomy.step_memory.activation_bytes
    # room for 1000 tokens of KV in the part of it a CPU worker's default pool may take
    small = HostMemory(int((reserved + 1000 * per_token) / CPU_MEM_FRACTION) + 1,
                       "the container's memory limit")
    monkeypatch.setattr(model_runner, "host_memory", lambda: small)
    runner = ModelRunner(EngineConfig(str(tiny_model), device="cpu"))
    assert 1000 - runner.config.page_size < runner.kv_pool.capacity <= 1000 < roomy.kv_pool.capacity
    with pytest.raises(ValueError) as err:
        ModelRunner(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=100_000))
    message = str(err.value)
    assert "the container's memory limit leaves" in message
    most = int(message.split("set kv_cache_tokens to at most ")[1].split(",")[0])
    assert ModelRunner(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=most)
                       ).kv_pool.capacity == most   # the advice fits


def test_a_decode_step_of_every_running_request_is_reserved_for(tiny_model):
    """A step decoding more requests than --max-prefill-tokens computes a token of each: its
    activations were sized from --max-prefill-tokens alone, so a pool sized to the byte could
    run out at a full decode batch without CUDA graphs."""
    runner = ModelRunner(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=256,
                                      max_prefill_tokens=64, chunked_prefill_size=64,
                                      max_running_requests=512))
    assert runner.step_memory.max_step_tokens == 512
    runner = ModelRunner(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=256,
                                      max_prefill_tokens=4096, max_running_requests=8))
    assert runner.step_memory.max_step_tokens == 4096
