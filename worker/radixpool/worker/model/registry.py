"""Which Hugging Face architectures we run, and the facts of a checkpoint's config we need.

The Llama, Mistral, Qwen2 and Qwen3 families share one decoder (`decoder.py`); what differs
between them is a handful of flags, read here from the `transformers` config into a frozen
`ModelSpec`. The registry is keyed by the name in `config.json`'s `architectures`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """What an architecture fixes; a bias of None follows the config's `attention_bias` /
    `mlp_bias` (as the `transformers` implementation of that architecture does)."""

    qkv_bias: bool | None
    o_bias: bool | None
    mlp_bias: bool | None
    qk_norm: bool


ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family(qkv_bias=None, o_bias=None, mlp_bias=None, qk_norm=False),
    "MistralForCausalLM": Family(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": Family(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
    "Qwen3ForCausalLM": Family(qkv_bias=None, o_bias=None, mlp_bias=False, qk_norm=True),
}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    # Tokens each token may attend back to, when the model was trained with a window.
    sliding_window: int | None
    # Whether every layer uses that window (Mistral's do; Qwen's only from max_window_layers on).
    window_in_every_layer: bool

    @property
    def yarn_context(self) -> int | None:
        """The context YaRN stretches the original one to (factor × original length), when the
        config asks for YaRN: the context served when it is more than max_position_embeddings
        (Qwen's cards add YaRN to a config whose max_position_embeddings is the original)."""
        params = self.rope_parameters
        if params.get("rope_type") != "yarn" or "original_max_position_embeddings" not in params:
            return None
        return int(float(params["factor"]) * params["original_max_position_embeddings"])


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """`rope_parameters` (transformers ≥ 5), or the older `rope_theta` + `rope_scaling` pair."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def model_spec(hf_config: Any) -> ModelSpec:
    """Read a `transformers` config; ValueError if its architecture is not one we implement."""
    names = list(getattr(hf_config, "architectures", None) or [])
    arch = next((n for n in names if n in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {names or '(none in config.json)'}; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    family = ARCHITECTURES[arch]
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization:
        method = (quantization.get("quant_method") if isinstance(quantization, dict)
                  else getattr(quantization, "quant_method", None))
        # The loader would copy quantized tensors as if they were plain weights (or, for
        # on-the-fly methods, quietly serve the model unquantized).
        raise ValueError(f"config.json quantization_config (quant_method {method!r}): quantized "
                         f"checkpoints are not supported; serve the unquantized (bf16/fp16) one")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch}: hidden_act must be 'silu', got {act!r}")
    num_heads = hf_config.num_attention_heads
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
    window = getattr(hf_config, "sliding_window", None)
    if not getattr(hf_config, "use_sliding_window", True):
        window = None  # Qwen2/Qwen3 configs carry a window they do not use unless asked to.
    # transformers (≥ 5) lists each layer's attention: Qwen's layers below max_window_layers
    # attend to the whole prefix.
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    if layer_types and "sliding_attention" not in layer_types:
        window = None
    return ModelSpec(
        architecture=arch,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
        rms_norm_eps=hf_config.rms_norm_eps,
        qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
        o_bias=attention_bias if family.o_bias is None else family.o_bias,
        mlp_bias=mlp_bias if family.mlp_bias is None else family.mlp_bias,
        qk_norm=family.qk_norm,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        rope_parameters=rope_parameters(hf_config),
        max_position_embeddings=hf_config.max_position_embeddings,
        sliding_window=window or None,
        window_in_every_layer=all(t == "sliding_attention" for t in layer_types),
    )
