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
leading-space strip) decode the new tokens exactly as a full decode would. The window advances to
the last token boundary that ends a real character (found within the last BOUNDARY_LOOKBACK
tokens when the text ends in U+FFFD), so it spans a few tokens: pushing N tokens costs O(N), not
O(N²).

Invariant: the concatenation of everything `push` and `flush` return equals
`tokenizer.decode(all_ids, skip_special_tokens)`. The one exception is a run of more than
MAX_PENDING_TOKENS tokens none of which ends a character (only invalid bytes: a broken model);
then the window is cut to bound the cost, and that garbage may decode to a different number of
U+FFFD than a full decode gives.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixpool.tokenization import PromptTokenizer

REPLACEMENT = "\ufffd"
MAX_PENDING_TOKENS = 64
BOUNDARY_LOOKBACK = 8  # an unfinished character is ≤ 3 bytes: a few tokens, maybe a special one


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
        end = len(self.ids)
        if end == self._read:
            return ""
        text = self._decode(self.ids[self._start:])
        done = len(self._context_text) + self._sent
        if not text.endswith(REPLACEMENT):
            self._advance(end, 0)
            return text[done:]
        stable = max(done, len(text.rstrip(REPLACEMENT)))
        for boundary in range(end - 1, max(self._read, end - BOUNDARY_LOOKBACK - 1), -1):
            head = self._decode(self.ids[self._start:boundary])
            if not head.endswith(REPLACEMENT):
                # ids[:boundary] ends a character: only the tokens after it stay in the window
                self._advance(boundary, stable - len(head))
                return text[done:stable]
        if end - self._read > MAX_PENDING_TOKENS:  # nothing but stray bytes for a long while
            self._advance(end, 0)
            return text[done:]
        self._sent = stable - len(self._context_text)
        return text[done:stable]

    def flush(self) -> str:
        """Return whatever is still held (the stream has ended)."""
        if len(self.ids) == self._read:
            return ""
        text = self._decode(self.ids[self._start:])
        done = len(self._context_text) + self._sent
        self._advance(len(self.ids), 0)
        return text[done:]

    def _advance(self, boundary: int, sent: int) -> None:
        """Everything before `boundary` is final; `sent` characters after it were emitted."""
        self._start, self._read = self._read, boundary
        self._context_text = self._decode(self.ids[self._start:self._read])
        self._sent = sent

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
