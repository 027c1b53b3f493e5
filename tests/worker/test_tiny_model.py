"""`radixpool tiny-model`: real architectures, loadable offline, the same files for a seed."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from transformers import AutoConfig, AutoTokenizer

from radixpool.tokenization import PromptTokenizer


def digest(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.iterdir()) if p.is_file()}


def test_cli_writes_the_same_model_for_the_same_seed(tmp_path, tiny_model_factory):
    from radixpool.worker.tiny_model import make_tiny_model

    subprocess.run([sys.executable, "-m", "radixpool.cli", "tiny-model", str(tmp_path / "cli"),
                    "--arch", "qwen2", "--seed", "0"], check=True, capture_output=True)
    make_tiny_model(tmp_path / "again", "qwen2", 0)
    assert digest(tmp_path / "cli") == digest(tmp_path / "again")
    assert digest(tmp_path / "cli") == digest(tiny_model_factory("qwen2", 0))
    other = make_tiny_model(tmp_path / "other", "qwen2", 1)
    assert digest(other)["model.safetensors"] != digest(tmp_path / "cli")["model.safetensors"]


@pytest.mark.parametrize("arch, hf_class", [
    ("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"), ("mistral", "MistralForCausalLM")])
def test_every_arch_loads_offline_with_tokenizer_and_chat_template(tiny_model_factory, arch,
                                                                    hf_class):
    path = tiny_model_factory(arch)
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [hf_class]
    hf_tok = AutoTokenizer.from_pretrained(path)
    ours = PromptTokenizer.from_dir(path)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "héllo 東京 🚀"}]
    expected = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert ours.encode_chat(messages) == list(expected)
    assert ours.encode("héllo world") == hf_tok("héllo world").input_ids
    for token in ("bos_token", "eos_token", "pad_token"):
        assert getattr(hf_tok, token) is not None
    generation = json.loads((path / "generation_config.json").read_text())
    assert hf_tok.convert_tokens_to_ids("<|im_end|>") in generation["eos_token_id"]


def test_sentencepiece_style_tokenizer_from_the_cli_loads_in_transformers(tmp_path):
    out = tmp_path / "sp"
    subprocess.run([sys.executable, "-m", "radixpool.cli", "tiny-model", str(out),
                    "--arch", "mistral", "--tokenizer", "sentencepiece"], check=True,
                   capture_output=True)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    assert tokenizer["model"]["byte_fallback"] is True
    assert tokenizer["pre_tokenizer"]["type"] == "Metaspace"
    hf_tok = AutoTokenizer.from_pretrained(out)
    ours = PromptTokenizer.from_dir(out)
    text = "héllo world Ω 東京"   # "Ω" is in no learned piece: byte fallback
    ids = ours.encode(text)
    assert ids == hf_tok(text).input_ids
    assert {"<0xCE>", "<0xA9>"} <= set(hf_tok.convert_ids_to_tokens(ids))
    assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True) == text
    assert AutoConfig.from_pretrained(out).vocab_size == ours.vocab_size


def test_the_template_renders_tools_calls_and_results_as_transformers_does(tiny_model):
    """The tools in the system turn, an assistant's calls as `<tool_call>` blocks and a tool's
    result: our renderer and `transformers` (given `tools=`) make the same tokens."""
    hf_tok = AutoTokenizer.from_pretrained(tiny_model)
    ours = PromptTokenizer.from_dir(tiny_model)
    tools = [{"type": "function", "function": {"name": "weather", "description": "météo",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}}}}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "東京"}'}}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    expected = hf_tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                          tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert ours.encode_chat(messages, tools=tools) == list(expected)
    text = ours.render_chat(messages, tools=tools)
    assert '"name": "weather"' in text.split("<|im_end|>")[0]   # listed in the system turn
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "東京"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
