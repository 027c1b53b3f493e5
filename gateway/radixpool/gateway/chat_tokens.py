"""Chat prompts tokenized piece by piece, with the pieces cached: the gateway's tokenizer budget.

Tokenizing a 2,000-token prompt costs the `tokenizers` library about a millisecond, several
times the gateway's whole per-request budget, and chat traffic resends the same system prompts
and conversation histories over and over. A rendered chat prompt is a sequence of pieces
separated by the tokenizer's added tokens (`<|im_start|>`, `<|im_end|>`, ...); the library
splits on those before anything else, so each piece tokenizes on its own, and encoding the
pieces separately gives the same ids as encoding the whole. Pieces (a system prompt, an earlier
turn, the role headers) are cached by their text as uint64 arrays, so a repeated prefix costs a
dict lookup and the prompt is one `np.concatenate` (the library's ~30 µs per call and a Python
list → array conversion are paid only for the new pieces).

That equivalence holds for the byte-level BPE tokenizers of the Llama/Qwen/Mistral families but
is not guaranteed for every normalizer, so it is checked, not assumed: the first
`VERIFY_FIRST` prompts and one in `VERIFY_EVERY` after that are also encoded whole, and one
mismatch turns the piece cache off for good (token-exact routing matters more than CPU).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from radixpool.protocol.kv_blocks import as_token_array
from radixpool.tokenization import PromptTokenizer

log = logging.getLogger("radixpool.gateway")

CACHE_ENTRIES = 16384
CACHE_CHARS = 64 << 20  # bound on the cached text too: one huge prompt must not pin gigabytes
VERIFY_FIRST = 16
VERIFY_EVERY = 256


def encode_ids(tokenizer: PromptTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode`, the same ids, through `encode_batch_fast`: it skips the character
    offsets (about a third of the cost of a short prompt) and releases the GIL (`encode` holds
    it: half a second for 250k characters, during which no other thread, the event loop's
    included, runs). The CLI turns the library's own thread pool off, so this stays on the
    calling thread."""
    return tokenizer.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[
        0].ids


class ChatEncoder:
    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self.tokenizer = tokenizer
        added = tokenizer.tokenizer.get_added_tokens_decoder().values()
        names = sorted({t.content for t in added if t.content}, key=len, reverse=True)
        self._ids = {name: tokenizer.token_id(name) for name in names}
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None
        self._cache: dict[str, np.ndarray] = {}
        self._cached_chars = 0
        self._calls = 0
        self.piecewise = self._split is not None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **kwargs: Any) -> np.ndarray:
        """The prompt's token ids (uint64), exactly as the worker's tokenizer makes them."""
        return self._encode_text(self.tokenizer.render_chat(messages, add_generation_prompt,
                                                            **kwargs))

    def encode_chat_prefix(self, messages: list[dict], add_generation_prompt: bool,
                           max_chars: int, **kwargs: Any) -> tuple[np.ndarray, bool]:
        """Token ids of at most the first `max_chars` characters of the rendered prompt, and
        whether it was cut (then the last ids may differ from the whole prompt's)."""
        text = self.tokenizer.render_chat(messages, add_generation_prompt, **kwargs)
        cut = len(text) > max_chars
        if cut:
            return as_token_array(encode_ids(self.tokenizer, text[:max_chars], False)), cut
        return self._encode_text(text), False

    def _encode_text(self, text: str) -> np.ndarray:
        if not self.piecewise:
            return as_token_array(encode_ids(self.tokenizer, text, False))
        ids = self._encode_pieces(text)
        self._calls += 1
        if self._calls <= VERIFY_FIRST or self._calls % VERIFY_EVERY == 0:
            whole = as_token_array(encode_ids(self.tokenizer, text, False))
            if not np.array_equal(whole, ids):
                log.warning("piecewise tokenization differs from whole-prompt tokenization for "
                            "this tokenizer; caching pieces is off from now on")
                self.piecewise = False
                self._cache.clear()
                self._cached_chars = 0
                return whole
        return ids

    def _encode_pieces(self, text: str) -> np.ndarray:
        assert self._split is not None
        cache = self._cache
        parts = []
        for i, piece in enumerate(self._split.split(text)):
            if not piece:
                continue
            cached = cache.get(piece)
            if cached is None:
                ids = [self._ids[piece]] if i % 2 else \
                    encode_ids(self.tokenizer, piece, False)
                cached = as_token_array(ids)
                self._remember(piece, cached)
            parts.append(cached)
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)

    def _remember(self, piece: str, ids: np.ndarray) -> None:
        cache = self._cache
        while cache and (len(cache) >= CACHE_ENTRIES
                         or self._cached_chars + len(piece) > CACHE_CHARS):
            oldest = next(iter(cache))  # insertion order: oldest first
            self._cached_chars -= len(oldest)
            del cache[oldest]
        if len(piece) <= CACHE_CHARS:
            cache[piece] = ids
            self._cached_chars += len(piece)
