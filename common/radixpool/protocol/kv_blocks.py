"""Chained block hashes: how a worker tells the gateway which token prefixes it holds.

A prompt of token ids is cut into fixed-size blocks (`block_size`, reported by the worker in
`/server_info`). Block `i` is named by a 64-bit hash of *everything before and including it*:
`tokens[0 : (i+1) * block_size]` plus the request's cache namespace. Two requests share block `i`'s
hash exactly when they share that whole prefix, so a set of hashes describes a set of prefixes,
and "how much of this prompt does worker W hold" is "how many leading block hashes of the prompt
are in W's set". Only whole blocks are named; a trailing partial block is never announced.

The hash is computed with vectorised numpy (no per-block Python loop): each block gets a mixed
digest, digests are chained by a polynomial recurrence `s_i = s_{i-1} * C + d_i (mod 2^64)` done as
a wrapped cumulative sum, and each state is mixed once more before it is published. The recurrence
and the constants are part of the wire contract: change them and every gateway must change too
(bump `HASH_SCHEME`).

Events (the worker's `/kv_events` stream) are JSON objects, one per radix-cache change:
    {"seq": 7, "type": "stored",  "blocks": ["9f0c…", …], "parent": "1a2b…" | null}
    {"seq": 8, "type": "removed", "blocks": ["9f0c…", …]}
    {"seq": 9, "type": "cleared"}
and one per request the worker has queued, naming its prompt's whole blocks before its prefill
computes them (the cache does not hold them yet; the `stored` event follows):
    {"seq": 10, "type": "queued", "blocks": ["9f0c…", …]}
`seq` increases by one per event; hashes are 16 lowercase hex digits. `parent` is the hash of the
block just before the first stored one (null when the first stored block is block 0). A reader
gets `queued` events only when it asks for them (`/kv_events?queued=1`).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from operator import mul
from typing import Literal

import numpy as np

HASH_SCHEME = "radixpool-chain-v1"
DEFAULT_BLOCK_SIZE = 16

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_CHAIN_MULT = 0xD6E8FEB86659FD93  # odd, so it is invertible modulo 2**64
_CHAIN_MULT_INV = pow(_CHAIN_MULT, -1, 1 << 64)


def _splitmix64_int(x: int) -> int:
    z = (x + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


_U_GOLDEN, _U_M1, _U_M2 = (np.uint64(c) for c in (_GOLDEN, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_U30, _U27, _U31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = z + _U_GOLDEN  # a new array; the rest works in place on it
    z ^= z >> _U30
    z *= _U_M1
    z ^= z >> _U27
    z *= _U_M2
    z ^= z >> _U31
    return z


def _weights(n: int) -> np.ndarray:
    out, state = [], 0x5EED
    for _ in range(n):
        state = _splitmix64_int(state)
        out.append(state | 1)
    return np.array(out, dtype=np.uint64)


class _Powers:
    """C**i and C**-i modulo 2**64, grown on demand and shared by every caller."""

    def __init__(self) -> None:
        self.fwd = np.ones(1, dtype=np.uint64)
        self.inv = np.ones(1, dtype=np.uint64)

    def upto(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.fwd) < n:
            size = max(n, 2 * len(self.fwd))
            fwd, inv = [1], [1]
            for _ in range(size - 1):
                fwd.append((fwd[-1] * _CHAIN_MULT) & _MASK)
                inv.append((inv[-1] * _CHAIN_MULT_INV) & _MASK)
            self.fwd = np.array(fwd, dtype=np.uint64)
            self.inv = np.array(inv, dtype=np.uint64)
        return self.fwd[:n], self.inv[:n]


_POWERS = _Powers()
_WEIGHT_CACHE: dict[int, np.ndarray] = {}
_WEIGHT_LISTS: dict[int, list[int]] = {}
# Up to this many blocks, plain integer arithmetic beats numpy's fixed cost per array operation
# (~2 us each, ~25 of them): 2 blocks hash in ~10 us instead of ~60.
SMALL_PROMPT_BLOCKS = 12


@lru_cache(maxsize=4096)  # a salt is per tenant or user: few distinct, many requests each
def namespace_seed(namespace: str | None) -> int:
    """The chain's starting state: requests in different namespaces never share a hash."""
    if not namespace:
        return _splitmix64_int(0)
    h = 0xCBF29CE484222325
    for byte in namespace.encode():
        h = ((h ^ byte) * 0x100000001B3) & _MASK
    return _splitmix64_int(h)


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as uint64, without a per-element Python conversion for plain lists."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.astype(np.uint64, copy=False)
    return np.frombuffer(array("q", token_ids), dtype=np.int64).view(np.uint64)


def chain_states(tokens: np.ndarray, block_size: int, prev_state: int) -> np.ndarray:
    """Chain states of the whole blocks of `tokens`, continuing from `prev_state`.

    `prev_state` is `namespace_seed(ns)` at the start of a prompt, or the last state returned for
    the blocks before `tokens` — so a cache can hash only what it newly stores.
    """
    num_blocks = len(tokens) // block_size
    if num_blocks == 0:
        return np.empty(0, dtype=np.uint64)
    weights = _WEIGHT_CACHE.get(block_size)
    if weights is None:
        weights = _WEIGHT_CACHE.setdefault(block_size, _weights(block_size))
    blocks = tokens[: num_blocks * block_size].reshape(num_blocks, block_size)
    digests = _splitmix64((blocks * weights).sum(axis=1, dtype=np.uint64))
    fwd, inv = _POWERS.upto(num_blocks + 1)
    # s_i = C^(i+1) * s_prev + sum_{k<=i} C^(i-k) * d_k  ==  C^i * (C*s_prev + cumsum(C^-k * d_k))
    start = np.uint64((prev_state * _CHAIN_MULT) & _MASK)
    return fwd[:num_blocks] * (np.cumsum(digests * inv[:num_blocks], dtype=np.uint64) + start)


def publish(states: np.ndarray) -> np.ndarray:
    """The published block hashes for chain states (one more mix, so states never leak)."""
    return _splitmix64(states)


def prefix_block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int = DEFAULT_BLOCK_SIZE,
    namespace: str | None = None,
) -> np.ndarray:
    """Hashes of every whole block of `token_ids`, as a uint64 array (one per block)."""
    return publish(chain_states(as_token_array(token_ids), block_size, namespace_seed(namespace)))


def prefix_block_hash_list(
    token_ids: Sequence[int] | bytes | np.ndarray,
    block_size: int = DEFAULT_BLOCK_SIZE,
    namespace: str | None = None,
) -> list[int]:
    """`prefix_block_hashes` as a list of ints, the same values, computed without numpy for
    short prompts (the gateway's per-request path). `bytes` hash as one unit per byte."""
    num_blocks = len(token_ids) // block_size
    if num_blocks > SMALL_PROMPT_BLOCKS:
        tokens = np.frombuffer(token_ids, dtype=np.uint8).astype(np.uint64) \
            if isinstance(token_ids, bytes) else as_token_array(token_ids)
        return prefix_block_hashes(tokens, block_size, namespace).tolist()
    if isinstance(token_ids, np.ndarray):
        token_ids = token_ids.tolist()
    weights = _WEIGHT_LISTS.get(block_size)
    if weights is None:
        weights = _WEIGHT_LISTS.setdefault(block_size, _weights(block_size).tolist())
    state, out = namespace_seed(namespace), []
    for start in range(0, num_blocks * block_size, block_size):
        digest = _splitmix64_int(sum(map(mul, token_ids[start:start + block_size], weights))
                                 & _MASK)
        state = (state * _CHAIN_MULT + digest) & _MASK
        out.append(_splitmix64_int(state))
    return out


def to_hex(hashes: np.ndarray | Sequence[int]) -> list[str]:
    return [f"{int(h):016x}" for h in hashes]


def from_hex(values: Sequence[str]) -> list[int]:
    return [int(v, 16) for v in values]


EventType = Literal["stored", "removed", "cleared", "queued"]
EVENT_TYPES = ("stored", "removed", "cleared", "queued")


@dataclass(frozen=True)
class KVEvent:
    """One change to a worker's radix cache, in block-hash terms."""

    seq: int
    type: EventType
    blocks: tuple[int, ...] = field(default=())
    parent: int | None = None

    def to_json(self) -> dict:
        doc: dict = {"seq": self.seq, "type": self.type}
        if self.type != "cleared":
            doc["blocks"] = to_hex(self.blocks)
        if self.type == "stored":
            doc["parent"] = None if self.parent is None else f"{self.parent:016x}"
        return doc

    @classmethod
    def from_json(cls, doc: dict) -> KVEvent:
        kind = doc["type"]
        if kind not in EVENT_TYPES:
            raise ValueError(f"unknown KV event type {kind!r}")
        parent = doc.get("parent")
        return cls(
            seq=int(doc["seq"]),
            type=kind,
            blocks=tuple(from_hex(doc.get("blocks", ()))),
            parent=None if parent is None else int(parent, 16),
        )
