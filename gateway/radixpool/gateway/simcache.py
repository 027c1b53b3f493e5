"""The simulated worker's model of a radix KV cache, and its tokenizer files.

`SimCache` holds whole blocks of token ids, named by the protocol's chained block hashes, bounded
by a KV capacity in tokens and evicted LRU leaf-first (blocks are touched last-to-first, so a
parent is always more recent than its children and the held set stays prefix-closed — a match is
a binary search). Every change is logged as a protocol KV event with a sequence number, in a
bounded buffer, exactly as `/kv_events` serves them. Cache hits are block-granular: a real worker
with page size 1 can reuse up to `block_size - 1` more tokens, which the gateway tolerates.

`sim_tokenizer_files()` is a word-level tokenizer (`w0` … `w{n}` plus chat roles and specials)
with a ChatML template: one token per word, so workloads control token counts exactly, and the
gateway builds the identical `PromptTokenizer` from `GET /tokenizer`.
"""

from __future__ import annotations

import json
from collections import OrderedDict, deque

import numpy as np

from radixpool.protocol.kv_blocks import KVEvent, prefix_block_hashes

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


class SimCache:
    def __init__(self, capacity_tokens: int, block_size: int, event_buffer: int = 4096) -> None:
        self.block_size = block_size
        self.capacity_blocks = max(1, capacity_tokens // block_size)
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.events: deque[KVEvent] = deque(maxlen=event_buffer)
        self.seq = 0

    def hashes(self, token_ids: list[int] | np.ndarray, namespace: str | None) -> list[int]:
        return prefix_block_hashes(token_ids, self.block_size, namespace).tolist()

    def match(self, hashes: list[int]) -> int:
        """Leading blocks held (the held set is prefix-closed, so binary search is exact)."""
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi) // 2
            if hashes[mid] in self.blocks:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def insert(self, hashes: list[int]) -> None:
        held = self.match(hashes)
        blocks = self.blocks
        for h in reversed(hashes):  # children first, so parents stay more recent
            blocks[h] = None
            blocks.move_to_end(h)
        if held < len(hashes):
            parent = hashes[held - 1] if held else None
            self._log("stored", tuple(hashes[held:]), parent)
        evicted = []
        while len(blocks) > self.capacity_blocks:
            evicted.append(blocks.popitem(last=False)[0])
        if evicted:
            self._log("removed", tuple(evicted))

    def clear(self) -> None:
        self.blocks.clear()
        self._log("cleared", ())

    def _log(self, kind: str, blocks: tuple[int, ...], parent: int | None = None) -> None:
        self.seq += 1
        self.events.append(KVEvent(self.seq, kind, blocks, parent))  # type: ignore[arg-type]

    def events_since(self, since: int) -> list[KVEvent] | None:
        """Events after `since`, or None when some were already dropped (client must resync)."""
        if since >= self.seq:
            return []
        if not self.events or self.events[0].seq > since + 1:
            return None
        return [e for e in self.events if e.seq > since]
