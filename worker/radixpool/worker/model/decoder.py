"""The decoder of the Llama / Mistral / Qwen2 / Qwen3 families (pre-norm, RoPE, GQA, gated MLP).

`CausalLM.forward(input_ids, positions)` returns the final hidden states of the step's new tokens;
the attention layers read the step's `ForwardBatch` (slots, lengths, the KV pool) from
`current_batch()` and hand it to the attention backend, which owns the paged KV cache.
`compute_logits(hidden)` projects the rows the caller chose through the LM head.

Parameter names follow the Hugging Face checkpoints, except the fused projections listed in
`CausalLM.packed_modules` (checkpoint module name → our fused module).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from radixpool.worker.attention.base import AttentionBackend
from radixpool.worker.forward_batch import current_batch
from radixpool.worker.model.layers import Embedding, FusedLinear, GatedMLP, Linear, RMSNorm
from radixpool.worker.model.registry import ModelSpec
from radixpool.worker.model.rotary import RotaryEmbedding


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = FusedLinear(
            spec.hidden_size, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
            bias=spec.qkv_bias)
        self.o_proj = Linear(q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        out = self.backend.forward(q, k, v, self.layer_id, current_batch())
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = SelfAttention(spec, layer_id, backend)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, backend) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(spec.head_dim, spec.rope_parameters)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class CausalLM(nn.Module):
    packed_modules: ClassVar[dict[str, str]] = {
        "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
        "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
    }

    def __init__(self, spec: ModelSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec, backend)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size)
        if spec.tie_word_embeddings:
            # One tensor for both: checkpoints of tied models carry only embed_tokens.weight.
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
