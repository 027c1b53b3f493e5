"""SGLang's reuse-aware eviction orders, for comparison with ours on the same radix cache.

SGLang (`--radix-eviction-policy`) orders eviction candidates by a priority tuple, smallest first:
- `lfu`: (hit count, last access). No ageing: a prefix reused often long ago outranks every
  prefix reused less, however recently.
- `slru`: (hit count >= 2, last access): a segmented LRU; prefixes reused at least twice are
  evicted only after every other leaf, by recency among themselves.

The hit count here is the node's `hits` (requests that found the node cached), which is what
SGLang's count measures since it was fixed to be incremented at all (sglang#18843: before, the
count stayed 0 and `lfu` was LRU). These run in the engine's own `RadixCache` through the
`EvictionPolicy` seam, so a comparison changes nothing but the order; they are benchmark
references, not worker options.

`reported` is what such a worker says its policy is: the gateway reads SGLang's
`radix_eviction_policy` under those names.
"""

from __future__ import annotations

from radixpool.worker.config import EVICTION_POLICIES
from radixpool.worker.mem.eviction import EvictableNode, EvictionPolicy

SLRU_PROTECTED_HITS = 2


class SGLangLFU(EvictionPolicy):
    name = "lfu"
    trims_leaves = False  # SGLang frees whole nodes

    def key(self, node: EvictableNode, now: int) -> tuple:
        return (node.hits, node.last_access)


class SGLangSLRU(EvictionPolicy):
    name = "slru"
    trims_leaves = False

    def key(self, node: EvictableNode, now: int) -> tuple:
        return (node.hits >= SLRU_PROTECTED_HITS, node.last_access)


SGLANG_POLICIES = {"sglang-lfu": SGLangLFU, "sglang-slru": SGLangSLRU}
BENCH_EVICTION_POLICIES = (*EVICTION_POLICIES, *SGLANG_POLICIES)


def eviction_policy(name: str) -> str | EvictionPolicy:
    """What `RadixCache` takes for a benchmark's `--eviction-policy` value."""
    cls = SGLANG_POLICIES.get(name)
    return name if cls is None else cls()


def reported(name: str) -> str:
    """The policy name a worker evicting by `name` reports to the gateway."""
    cls = SGLANG_POLICIES.get(name)
    return name if cls is None else cls.name
