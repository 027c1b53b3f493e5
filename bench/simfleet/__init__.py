"""Simulated RadixPool workers, outside the product package (production images do not carry
them): the worker protocol over the engine's own radix cache, for tests and the routing
benchmark. `python -m bench.simfleet --count N` serves N of them on loopback."""

from .fleet import SimFleet, kill
from .kv import SimKV, sim_tokenizer_files
from .worker import SimConfig, SimWorker

__all__ = ["SimConfig", "SimFleet", "SimKV", "SimWorker", "kill", "sim_tokenizer_files"]
