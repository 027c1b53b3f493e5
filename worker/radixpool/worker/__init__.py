"""The RadixPool worker: an LLM engine with a radix-tree prefix KV cache, and its server.

`from radixpool.worker import Engine` is the offline API. The import is lazy so that light
modules of this package (the CLI, the tiny-model maker) load without torch.
"""

from typing import Any

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixpool.worker.engine import Engine

        return Engine
    raise AttributeError(f"module 'radixpool.worker' has no attribute {name!r}")
