"""The simulated worker's KV cache: the engine's own `RadixCache` (same class, same eviction
policies, same KV events) over a pool that only counts slots, and the simulated tokenizer.

`SimKV.prefill` plays one request the way the engine's scheduler does: match the longest cached
prefix (never the prompt's last token: the model must compute its logits), lock it, make room for
the uncached rest by evicting, cache the whole prompt, unlock. Slot runs are `range`s, so nothing
here needs torch. Events go into the worker's own `KVEventLog` (bounded, read by sequence number,
any number of long-polling readers), exactly as `/kv_events` serves them.

`sim_tokenizer_files()` is a word-level tokenizer (`w0` … `w{n}` plus chat roles and specials)
with a ChatML template: one token per word, so workloads control token counts exactly, and the
gateway builds the identical `PromptTokenizer` from `GET /tokenizer`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from radixpool.protocol.kv_blocks import KVEvent, prefix_block_hashes
from radixpool.worker.kv_event_log import KVEventLog
from radixpool.worker.mem.radix_cache import RadixCache

from .sglang_eviction import eviction_policy as bench_eviction

SPECIALS = ("[UNK]", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + ' ' + message['content'] + ' <|im_end|> ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)


def sim_tokenizer_files(words: int = 4096) -> dict[str, str]:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate((*SPECIALS, *ROLES, *(f"w{i}" for i in range(words))))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "[UNK]",
              "chat_template": CHAT_TEMPLATE}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config)}


class CountingPool:
    """A KV pool that only counts free slots; a slot run is a `range` of its length."""

    device = None

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free_slots = capacity

    def available_size(self) -> int:
        return self.free_slots

    def alloc(self, n: int) -> range | None:
        if n > self.free_slots:
            return None
        self.free_slots -= n
        return range(n)

    def free(self, run: Sequence[int]) -> None:
        self.free_slots += len(run)


class RangeRuns:
    """`SlotRuns` over `range`s: only lengths matter in the simulation."""

    def empty(self) -> range:
        return range(0)

    def concat(self, runs: Sequence[range]) -> range:
        return range(sum(len(r) for r in runs))

    def own(self, run: range) -> range:
        return run


class SimKV:
    def __init__(self, capacity_tokens: int, block_size: int, eviction_policy: str = "lru",
                 event_buffer: int = 4096) -> None:
        self.block_size = block_size
        self.pool = CountingPool(capacity_tokens)
        self.cache = RadixCache(self.pool, 1, block_size, bench_eviction(eviction_policy),
                                RangeRuns())
        self.events = KVEventLog(event_buffer)

    @property
    def seq(self) -> int:
        return self.cache.snapshot()[0]

    @property
    def blocks(self) -> list[int]:
        return self.cache.snapshot()[1]

    def usage(self) -> float:
        return 1 - self.pool.free_slots / self.pool.capacity

    def hashes(self, token_ids: Sequence[int], namespace: str | None) -> list[int]:
        return prefix_block_hashes(list(token_ids), self.block_size, namespace).tolist()

    def probe(self, token_ids: list[int], namespace: str | None) -> int:
        return min(self.cache.probe(token_ids, namespace), max(0, len(token_ids) - 1))

    def start(self, token_ids: list[int], namespace: str | None):
        """Admit a prefill: returns (cached tokens, handle for `finish`). The matched prefix is
        locked until `finish`, so other prefills cannot evict what this one reuses."""
        match = self.cache.match_prefix(token_ids[:max(0, len(token_ids) - 1)], namespace)
        self.cache.lock(match.node)
        return match.length, match

    def finish(self, token_ids: list[int], namespace: str | None, match) -> list[KVEvent]:
        """The prefill is done: cache the prompt (evicting to make room), unlock, and return
        the KV events this caused. A prompt the pool cannot hold even after eviction is simply
        not cached, as when every other slot is locked."""
        cache = self.cache
        need = len(token_ids) - match.length
        if self.pool.free_slots < need:
            cache.evict(need - self.pool.free_slots)
        new = self.pool.alloc(need)
        if new is not None:
            present = cache.insert(token_ids, range(len(token_ids)), namespace)
            # Slots of [match.length, present) duplicate what the tree already has: free them.
            self.pool.free(range(max(0, present - match.length)))
        cache.unlock(match.node)
        events = cache.drain_events()
        self.events.append(events)
        return events

    def announce(self, token_ids: list[int], namespace: str | None) -> list[KVEvent]:
        """A request was queued here: the `queued` event naming its prompt's blocks, as the
        engine's scheduler emits it (`RadixCache.announce`)."""
        self.cache.announce(token_ids, namespace)
        events = self.cache.drain_events()
        self.events.append(events)
        return events

    def prefill(self, token_ids: list[int], namespace: str | None) -> int:
        cached, match = self.start(token_ids, namespace)
        self.finish(token_ids, namespace, match)
        return cached

    def clear(self) -> None:
        self.cache.reset()
        self.events.append(self.cache.drain_events())

    def events_since(self, since: int) -> list[KVEvent] | None:
        """Events after `since`, or None when some were already dropped (client must resync)."""
        return self.events.events_since(since)
