"""Fill a model's parameters from a Hugging Face safetensors checkpoint (one file or sharded).

A checkpoint tensor is found by name: `model.layers.3.self_attn.k_proj.weight` goes to parameter
`model.layers.3.self_attn.qkv_proj.weight` as shard `k_proj` (the model's `packed_modules` says
which modules are fused), everything else to the parameter of the same name. The parameter's
`weight_loader` copies it in, converting dtype and device. Every parameter (every shard of a fused
one) must be filled exactly once and every tensor used, else the error names them.

A tied parameter (`lm_head.weight` sharing `model.embed_tokens.weight`) is filled from its own
name. A checkpoint that also stores the other name with a different value (a config saying
`tie_word_embeddings` over weights that are not) unties them, as `transformers` does: each
keeps its own tensor.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

log = logging.getLogger(__name__)

# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    # Mistral's repos also ship their own format (`consolidated*.safetensors`, other tensor
    # names) beside the Hugging Face one.
    files = sorted(p for p in model_dir.glob("*.safetensors")
                   if not p.name.startswith("consolidated"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors checkpoint in {model_dir} "
                                "(PyTorch .bin checkpoints are not supported)")
    return files


def _target(name: str, packed: dict[str, str]) -> tuple[str, str | None]:
    """Checkpoint tensor name → (parameter name, shard id or None)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            return ".".join([*parts[:i], packed[part], *parts[i + 1:]]), part
    return name, None


def _checkpoint_name(param_name: str, shard: str | None, packed: dict[str, str]) -> str:
    if shard is None:
        return param_name
    return param_name.replace(f".{packed[shard]}.", f".{shard}.")


def load_checkpoint(model: nn.Module, model_dir: str | Path) -> None:
    packed: dict[str, str] = getattr(model, "packed_modules", {})
    params = dict(model.named_parameters())  # a tied parameter appears once, by its first name
    # Every name a parameter answers to (a tied lm_head.weight included) → its canonical name.
    canonical: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical[name] = first_name.setdefault(id(p), name)
    expected = {(name, shard) for name, p in params.items()
                for shard in getattr(p, "shard_ids", (None,))}
    loaded: set[tuple[str, str | None]] = set()
    unexpected: list[str] = []
    aliases: dict[str, Path] = {}   # tied parameter names but the canonical one → their file
    with torch.no_grad():
        for path in checkpoint_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    param_name, shard = _target(name, packed)
                    if param_name not in canonical:
                        unexpected.append(name)
                        continue
                    if canonical[param_name] != param_name:
                        aliases[param_name] = path   # (a tied parameter is never fused)
                        continue
                    param = params[param_name]
                    try:
                        param.weight_loader(param, f.get_tensor(name), shard)
                    except ValueError as e:
                        raise ValueError(f"{path.name}: {name}: {e}") from None
                    loaded.add((param_name, shard))
        for name, path in aliases.items():
            _load_alias(model, canonical[name], params[canonical[name]], name, path, loaded)
    missing = sorted(_checkpoint_name(n, s, packed) for n, s in expected - loaded)
    if missing or unexpected:
        raise ValueError(f"checkpoint {model_dir} does not match {type(model).__name__}: "
                         f"missing tensors {_listing(missing)}; "
                         f"unexpected tensors {_listing(sorted(unexpected))}")


def _load_alias(model: nn.Module, canonical: str, tied: nn.Parameter, name: str, path: Path,
                loaded: set[tuple[str, str | None]]) -> None:
    """Checkpoint tensor `name` of a parameter tied to `tied` (named `canonical`): fills `tied`
    when the checkpoint has nothing under `canonical`, is dropped when equal to it, else unties
    `name`."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        tensor = f.get_tensor(name)
    if (canonical, None) not in loaded:
        tied.weight_loader(tied, tensor, None)
        loaded.add((canonical, None))
        return
    if torch.equal(tensor.to(tied.dtype), tied.cpu()):
        return
    log.warning("config.json ties %s to %s, but the checkpoint stores a different %s: untied, "
                "as transformers does", name, canonical, name)
    own = nn.Parameter(torch.empty_like(tied), requires_grad=False)
    own.weight_loader = tied.weight_loader
    own.weight_loader(own, tensor, None)
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, own)


def _listing(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
