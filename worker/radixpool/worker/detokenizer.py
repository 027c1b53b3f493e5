"""Incremental detokenization: token ids in, only newly *complete* text out.

A byte-level tokenizer splits one character over several tokens ("🚀" is four bytes, often two or
three tokens), and decoding a prefix that ends inside a character yields U+FFFD. So each push
re-decodes a small window, `ids[start:]`, and emits only its *stable* part:
  - if the window's text ends in a real character, the whole text is final: a complete UTF-8
    character is never re-read differently whatever bytes follow, and decoding restarts after it;
  - if it ends in U+FFFD, the trailing run of U+FFFD may be an incomplete character still waiting
    for bytes, so everything before that run is emitted and the run is held.
The window keeps one emitted stretch of tokens in front as context (`ids[start:read]`, decoded
once into `_context_text`), so decoders that treat the first token specially (SentencePiece's
leading-space strip) decode the new tokens exactly as a full decode would. The window advances
whenever the text ends on a real character, so it spans a few tokens: pushing N tokens costs O(N),
not O(N²).

Invariant: the concatenation of everything `push` and `flush` return equals
`tokenizer.decode(all_ids, skip_special_tokens)`. The one exception is a stream of more than
MAX_PENDING_TOKENS tokens none of which ends a character (only invalid bytes: a broken model);
then the window is cut to bound the cost, and that garbage may decode to a different number of
U+FFFD than a full decode gives.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixpool.tokenization import PromptTokenizer

REPLACEMENT = "\ufffd"
MAX_PENDING_TOKENS = 64


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PromptTokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._start = 0          # window start: ids before it are never decoded again
        self._read = 0           # ids before it are emitted; ids[start:read] is context
        self._context_text = ""  # decode(ids[start:read])
        self._sent = 0           # characters past the context already emitted (held-run split)

    def push(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the text they completed (possibly "")."""
        self.ids.extend(token_ids)
        if len(self.ids) == self._read:
            return ""
        text = self._decode(self.ids[self._start:])
        done = len(self._context_text) + self._sent
        if not text.endswith(REPLACEMENT) or len(self.ids) - self._read > MAX_PENDING_TOKENS:
            self._advance()
            return text[done:]
        stable = len(text.rstrip(REPLACEMENT))
        if stable <= done:
            return ""
        self._sent += stable - done
        return text[done:stable]

    def flush(self) -> str:
        """Return whatever is still held (the stream has ended)."""
        if len(self.ids) == self._read:
            return ""
        text = self._decode(self.ids[self._start:])
        done = len(self._context_text) + self._sent
        self._advance()
        return text[done:]

    def _advance(self) -> None:
        self._start, self._read = self._read, len(self.ids)
        self._context_text = self._decode(self.ids[self._start:self._read])
        self._sent = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
