"""The RadixPool worker: an LLM engine with a radix-tree prefix KV cache, and its server.

`from radixpool.worker import Engine` is the offline API, with the types its callers name
(`EngineBusy`, `EngineStartCancelled`, `StreamChunk`, `SamplingParams`). The imports are lazy so
that light modules of this package (the CLI, the tiny-model maker) load without torch.
"""

from importlib import import_module
from typing import Any

_PUBLIC = {
    "Engine": "radixpool.worker.engine",
    "EngineBusy": "radixpool.worker.engine_errors",
    "EngineStartCancelled": "radixpool.worker.engine_errors",
    "StreamChunk": "radixpool.worker.request_output",
    "SamplingParams": "radixpool.worker.sampling_params",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'radixpool.worker' has no attribute {name!r}")
