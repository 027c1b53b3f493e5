"""Attention backends over the paged KV pool, behind one interface and a registry.

Importing this package registers the built-in backends; each is imported only when created.
"""

from radixpool.worker.attention.base import register_backend


def _torch_backend():
    from radixpool.worker.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend


register_backend("torch", _torch_backend)
