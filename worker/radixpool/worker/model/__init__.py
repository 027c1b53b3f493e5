"""Our implementations of the supported model families, and their checkpoint loader."""

from radixpool.worker.model.decoder import CausalLM
from radixpool.worker.model.loader import load_checkpoint
from radixpool.worker.model.registry import ARCHITECTURES, ModelSpec, model_spec

__all__ = ["ARCHITECTURES", "CausalLM", "ModelSpec", "load_checkpoint", "model_spec"]
