"""The published configurations of the models the GPU benchmarks measure, written out without
their weights (nothing is downloaded: the engine fills them with random values,
`EngineConfig.random_weights`).

`write_reference_config(dir, name, **overrides)` writes `config.json`; overrides scale a model down
(e.g. `num_hidden_layers=2, hidden_size=256`) so the same benchmark runs end to end on a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REFERENCE_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "tie_word_embeddings": True,
        "attention_bias": False, "rope_theta": 1000000.0,
        "use_sliding_window": False, "sliding_window": None,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
}


def write_reference_config(directory: str | Path, name: str, **overrides: Any) -> Path:
    """Write `config.json` of a reference model (scaled by `overrides`) into `directory`."""
    if name not in REFERENCE_CONFIGS:
        raise ValueError(f"model must be one of {', '.join(REFERENCE_CONFIGS)}, got {name!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {**REFERENCE_CONFIGS[name], **overrides}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
