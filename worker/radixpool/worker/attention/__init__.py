"""Attention backends over the paged KV pool, behind one interface and a registry.

Importing this package registers the built-in backends; each is imported only when created, so
`flashinfer` is imported only when its backend is chosen (never on a CPU install).
"""

from radixpool.worker.attention.base import register_backend


def _torch_backend():
    from radixpool.worker.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend


def _flashinfer_backend():
    from radixpool.worker.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend


register_backend("torch", _torch_backend)
register_backend("flashinfer", _flashinfer_backend)
