"""Checkpoints load as users have them (sharded, tied, older config spellings), and the ones we
cannot run fail with an error that says why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from model_driver import Driver
from safetensors.torch import load_file, save_file

from radixpool.worker.config import EngineConfig
from radixpool.worker.mem.kv_pool import KVPool
from radixpool.worker.model.registry import rope_parameters
from radixpool.worker.model.rotary import rope_inv_freq
from radixpool.worker.model_runner import CPU_KV_BYTES, CPU_KV_CONTEXTS, ModelRunner

PROMPT = [7, 300, 42, 999, 12, 5, 77, 640, 18, 1000]


def runner_for(path: Path, **overrides) -> ModelRunner:
    config = dict(device="cpu", kv_cache_tokens=256, max_running_requests=2)
    config.update(overrides)
    return ModelRunner(EngineConfig(model_path=str(path), **config))


def prompt_logits(runner: ModelRunner) -> torch.Tensor:
    return Driver(runner).prompt_logits(PROMPT)


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_sharded_checkpoint_loads_the_same_weights(tiny_model_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_model_factory("llama")
    sharded = copy_model(src, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(sharded, max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (sharded / "model.safetensors").exists()
    assert torch.equal(prompt_logits(runner_for(sharded)), prompt_logits(runner_for(src)))


def test_mistral_consolidated_file_beside_the_checkpoint_is_not_read(tiny_model_factory,
                                                                     tmp_path):
    src = tiny_model_factory("mistral")
    path = copy_model(src, tmp_path / "m")
    save_file({"layers.0.attention.wq.weight": torch.ones(64, 64)},
              path / "consolidated.safetensors")
    assert torch.equal(prompt_logits(runner_for(path)), prompt_logits(runner_for(src)))


def test_tied_embeddings_share_one_tensor(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    runner = runner_for(path)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight


def test_tied_checkpoint_that_also_stores_lm_head_loads(tiny_model_factory, tmp_path):
    path = copy_model(tiny_model_factory("qwen3"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert torch.equal(prompt_logits(runner_for(path)),
                       prompt_logits(runner_for(tiny_model_factory("qwen3"))))


def test_tied_config_over_a_different_lm_head_unties_as_transformers_does(tiny_model_factory,
                                                                         tmp_path):
    from transformers import AutoModelForCausalLM

    path = copy_model(tiny_model_factory("qwen2"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    head = {"lm_head.weight": (tensors["model.embed_tokens.weight"] * 0.5).contiguous()}
    for order in ({**head, **tensors}, {**tensors, **head}):
        save_file(order, path / "model.safetensors", metadata={"format": "pt"})
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            expected = hf(torch.tensor([PROMPT])).logits[0]
        torch.testing.assert_close(prompt_logits(runner_for(path)), expected, atol=1e-5, rtol=0)


def test_chat_fine_tune_stops_at_its_tokenizers_eos(tiny_model_factory, tmp_path):
    from radixpool.tokenization import PromptTokenizer
    from radixpool.worker.engine_core import EngineCore
    from radixpool.worker.messages import GenerateRequest
    from radixpool.worker.sampling_params import SamplingParams

    # A base model's configs (EOS </s> only), a chat fine-tune's tokenizer (EOS <|im_end|>).
    path = copy_model(tiny_model_factory("qwen2"), tmp_path / "m")
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = generation["eos_token_id"][0]
    (path / "generation_config.json").write_text(json.dumps(generation))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = "<|im_end|>"
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    im_end = PromptTokenizer.from_dir(path).token_id("<|im_end|>")

    core = EngineCore(EngineConfig(str(path), device="cpu", kv_cache_tokens=256))
    params = SamplingParams(max_new_tokens=8, temperature=0, logit_bias={im_end: 100.0})
    assert core.add_request(GenerateRequest("r", PROMPT, params, seed=0)) is None
    deltas = []
    while core.has_work:
        deltas += core.step().deltas
    assert [t for d in deltas for t in d.token_ids] == [im_end]
    assert deltas[-1].finish_reason == "stop"


def test_generation_config_sampling_defaults_apply_to_requests_that_leave_them_out(
        tiny_model_factory, tmp_path):
    from radixpool.worker import Engine

    path = copy_model(tiny_model_factory("llama"), tmp_path / "m")
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, "top_k": 1}))
    asked = {"max_new_tokens": 8, "ignore_eos": True}
    with Engine(str(path), device="cpu", kv_cache_tokens=512) as engine:
        def tokens(**params) -> list[int]:
            return engine.generate(input_ids=PROMPT,
                                   sampling_params={**asked, **params})["output_ids"]

        greedy = tokens(temperature=0)
        assert [tokens(seed=seed) for seed in range(3)] == [greedy] * 3   # top_k 1: greedy
        assert greedy not in [tokens(seed=seed, top_k=-1) for seed in range(3)]


def test_out_of_range_generation_config_default_fails_at_start(tiny_model_factory, tmp_path):
    path = copy_model(tiny_model_factory("llama"), tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be in \(0, 1\]"):
        runner_for(path)


def test_unsupported_architecture_is_named(tiny_model_factory, tmp_path):
    path = copy_model(tiny_model_factory("llama"), tmp_path / "m")
    edit_config(path, architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ValueError, match=r"unsupported architecture.*LlamaForSequenceClassific"
                                         r"ation.*supported: LlamaForCausalLM"):
        runner_for(path)


@pytest.mark.parametrize("quantization", [
    {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    {"quant_method": "bitsandbytes", "load_in_4bit": True}])
def test_quantized_checkpoint_is_refused_naming_quantization_config(tiny_model_factory, tmp_path,
                                                                    quantization):
    path = copy_model(tiny_model_factory("llama"), tmp_path / "m")
    edit_config(path, quantization_config=quantization)
    with pytest.raises(ValueError, match=r"config.json quantization_config \(quant_method "
                                         rf"'{quantization['quant_method']}'\): quantized "
                                         r"checkpoints are not supported"):
        runner_for(path)


def test_model_path_must_be_a_local_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="local Hugging Face model directory"):
        runner_for(tmp_path)


def test_missing_and_unexpected_tensors_are_named(tiny_model_factory, tmp_path):
    path = copy_model(tiny_model_factory("mistral"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.layers.0.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # ignored
    tensors["model.layers.0.self_attn.extra.weight"] = torch.ones(2)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        runner_for(path)
    message = str(error.value)
    assert ("missing tensors model.layers.0.mlp.up_proj.weight, "
            "model.layers.1.self_attn.k_proj.weight;") in message
    assert "unexpected tensors model.layers.0.self_attn.extra.weight" in message


def test_wrong_tensor_shape_is_named(tiny_model_factory, tmp_path):
    path = copy_model(tiny_model_factory("llama"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.v_proj.weight"] = torch.ones(8, 64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"v_proj.weight: checkpoint tensor has shape \(8, 64\), "
                                         r"the model expects \(32, 64\)"):
        runner_for(path)


def test_linear_rope_scaling_matches_hf(tiny_model_factory, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = copy_model(tiny_model_factory("llama"), tmp_path / "m")
    edit_config(path, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    hf = AutoModelForCausalLM.from_pretrained(path, config=AutoConfig.from_pretrained(path))
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prompt_logits(runner_for(path)), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch, rope_scaling", [
    ("qwen2", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    ("qwen3", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4,
               "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2})])
def test_yarn_rope_scaling_matches_hf(tiny_model_factory, tmp_path, arch, rope_scaling):
    from transformers import AutoModelForCausalLM

    path = copy_model(tiny_model_factory(arch), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    del config["rope_parameters"]   # as Qwen's model cards say to enable YaRN
    config.update(rope_theta=1e6, rope_scaling=rope_scaling)
    (path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    assert hf.model.rotary_emb.attention_scaling != 1.0
    torch.testing.assert_close(prompt_logits(runner_for(path)), expected, atol=1e-5, rtol=0)


def test_yarn_stretches_the_context_length(tiny_model_factory, tmp_path):
    path = copy_model(tiny_model_factory("qwen2"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    del config["rope_parameters"]
    config.update(rope_theta=1e6, max_position_embeddings=2048, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048})
    (path / "config.json").write_text(json.dumps(config))
    assert runner_for(path).context_length == 8192
    with pytest.raises(ValueError, match=r"\(8192 tokens: config.json rope_scaling factor"):
        runner_for(path, context_length=8193)


def test_older_rope_config_spelling():
    legacy = SimpleNamespace(rope_theta=500000.0, rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    params = rope_parameters(legacy)
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 500000.0
    assert rope_parameters(SimpleNamespace(rope_theta=1e6)) == {
        "rope_theta": 1e6, "rope_type": "default"}
    slowed = rope_inv_freq(128, params)
    plain = rope_inv_freq(128, {"rope_theta": 500000.0})
    assert torch.equal(slowed[:8], plain[:8])  # short wavelengths untouched
    torch.testing.assert_close(slowed[-4:], plain[-4:] / 8.0)  # long ones slowed by `factor`


def test_unknown_rope_type_is_rejected():
    with pytest.raises(ValueError, match=r"config.json rope_scaling \(rope_parameters\): "
                                         r"rope_type must be one of default, linear, llama3, "
                                         r"yarn, got 'dynamic'"):
        rope_inv_freq(64, {"rope_type": "dynamic", "factor": 2.0})


def test_sliding_window_caps_the_context_only_without_window_attention(tiny_model_factory,
                                                                      tmp_path, monkeypatch):
    from radixpool.worker.attention.torch_backend import TorchAttentionBackend

    path = copy_model(tiny_model_factory("mistral"), tmp_path / "m")
    edit_config(path, sliding_window=512)
    assert runner_for(path).context_length == 2048   # max_position_embeddings
    monkeypatch.setattr(TorchAttentionBackend, "supports_sliding_window", False)
    assert runner_for(path).context_length == 512
    with pytest.raises(ValueError, match=r"context_length may only shrink the model's context "
                                         r"\(512 tokens: config.json sliding_window"):
        runner_for(path, context_length=1024)
    assert runner_for(path, context_length=100).context_length == 100


@pytest.mark.parametrize("use_window, max_window_layers, context", [
    (False, 0, 2048),   # Qwen's published configs: a window nobody uses
    (True, 2, 2048),    # enabled, but from layer 2 on (of 2): still none
    (True, 0, 2048),    # every layer: attended within the window
    (True, 1, 16)])     # layer 1 only: the context is capped at the window
def test_qwen_window_follows_use_sliding_window_and_max_window_layers(
        tiny_model_factory, tmp_path, use_window, max_window_layers, context):
    from transformers import AutoModelForCausalLM

    path = copy_model(tiny_model_factory("qwen2"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    del config["layer_types"]   # published configs have none: transformers derives them
    config.update(sliding_window=16, use_sliding_window=use_window,
                  max_window_layers=max_window_layers)
    (path / "config.json").write_text(json.dumps(config))
    runner = runner_for(path)
    assert runner.context_length == context
    if context > 16:
        prompt = PROMPT * 3   # longer than the window
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(Driver(runner).prompt_logits(prompt), expected, atol=1e-5,
                                   rtol=0)


def test_cpu_kv_cache_sizing(tiny_model_factory):
    path = tiny_model_factory("llama")
    runner = runner_for(path, kv_cache_tokens=None)
    per_token = KVPool.bytes_per_token(2, 2, 16, torch.float32)
    assert runner.kv_pool.capacity == min(CPU_KV_CONTEXTS * 2048, CPU_KV_BYTES // per_token)
    assert runner_for(path, kv_cache_tokens=100, page_size=8).kv_pool.capacity == 96
    with pytest.raises(ValueError, match=r"mem_fraction .* on CPU set kv_cache_tokens"):
        runner_for(path, kv_cache_tokens=None, mem_fraction=0.5)
