"""Incremental detokenization: token ids in, only newly *final* text out.

Each push re-decodes a small window, `ids[start:]`, and emits only the part no later token can
change. Two things make a decoded tail unfinished:
  - a byte-level tokenizer splits one character over several tokens ("🚀" is four bytes, often
    two or three tokens); decoding a prefix that ends inside a character yields U+FFFD. A
    trailing run of U+FFFD is held; everything before it is emitted;
  - a byte-fallback tokenizer (SentencePiece style: `<0xE6>`, ...) decodes a *run* of byte tokens
    as one byte string, and if the run is not valid UTF-8 every byte of it becomes U+FFFD, even
    the ones that were complete characters alone. So the text of a trailing run of byte tokens
    is held until a token that is not a byte token closes the run (skipped special tokens are
    dropped before decoding: they do not close it).
The window keeps already emitted tokens in front as context (`ids[start:read]`, decoded once into
`_context_text`), because decoders treat the first token specially: SentencePiece's decoder strips
the one leading space its dummy prefix added. A context that decodes to nothing (skipped special
tokens) would let that strip eat a real space, so the window then keeps its older context. The
first output tokens get the prompt's last tokens as context (as SGLang does), so a completion
keeps its leading space. The window advances to the last token boundary where the text is final
(searched within the last BOUNDARY_LOOKBACK tokens), so pushing N tokens costs O(N), not O(N²),
and pushing them one by one or together gives the same text.

Invariant: the concatenation of everything `push` and `flush` return equals
`decode(context + all_ids)[len(decode(context)):]` (with no prompt context: `decode(all_ids)`).
The one exception is a run of more than MAX_PENDING_TOKENS tokens none of which ends a character
(only invalid bytes: a broken model); then the window is cut to bound the cost, and that garbage
may decode to a different number of U+FFFD than a full decode gives.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from radixpool.tokenization import PromptTokenizer

REPLACEMENT = "\ufffd"
MAX_PENDING_TOKENS = 64
BOUNDARY_LOOKBACK = 8  # an unfinished character is ≤ 3 bytes: a few tokens, maybe a special one
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PromptTokenizer, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._bytes = tokenizer.byte_fallback_ids
        # tokens a byte run reaches across: skipped special tokens vanish before decoding
        self._in_run = self._bytes | tokenizer.special_ids if skip_special_tokens else self._bytes
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        ends_in_bytes = bool(context) and context[-1] in self._bytes
        while context and context[-1] in self._bytes:  # an open run would merge with the output
            context.pop()
        context_text = self._decode(context)
        if not context_text or context_text.endswith(REPLACEMENT):
            # Nothing usable in front: decode from scratch, unless the prompt's text ends in
            # byte tokens. The output is then not the text's start (whose leading space a
            # SentencePiece decoder strips): a plain token stands in for the prompt.
            context = tokenizer.encode("a", add_special_tokens=False)[-1:] if ends_in_bytes else []
            context_text = self._decode(context)
            if not context_text or context_text.endswith(REPLACEMENT):
                context, context_text = [], ""
        self.ids: list[int] = context   # the context, then the output
        self._start = 0          # window start: ids before it are never decoded again
        self._read = len(context)  # ids before it are emitted; ids[start:read] is context
        self._context_text = context_text  # decode(ids[start:read])
        self._sent = 0           # characters past the context already emitted (held-tail split)

    def push(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the text they completed (possibly "")."""
        ids = self.ids
        ids.extend(token_ids)
        end = len(ids)
        if end == self._read:
            return ""
        text = self._decode(ids[self._start:])
        done = len(self._context_text) + self._sent
        open_run = end   # start of a trailing run of byte-fallback tokens (end: none)
        if self._bytes:
            while open_run > self._read and ids[open_run - 1] in self._in_run:
                open_run -= 1
            if not self._bytes.intersection(ids[open_run:]):
                open_run = end   # only special tokens: nothing is held open
        if open_run == end and not text.endswith(REPLACEMENT):
            self._advance(end, 0)
            return text[done:]
        settled = text if open_run == end else self._decode(ids[self._start:open_run])
        stable = max(done, len(settled.rstrip(REPLACEMENT)))
        for boundary in range(min(end - 1, open_run), max(self._read, end - BOUNDARY_LOOKBACK - 1),
                              -1):
            if self._bytes and self._splits_run(boundary):
                continue   # inside a run of byte tokens: its bytes decode together
            head = self._decode(ids[self._start:boundary])
            if not head.endswith(REPLACEMENT):
                # ids[:boundary] is final: only the tokens after it stay in the window
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
        start = self._read
        context = self._decode(self.ids[start:boundary])
        if not context and boundary - self._start <= MAX_PENDING_TOKENS:
            start = self._start   # the new stretch decodes to nothing: keep the older context
            context = self._decode(self.ids[start:boundary])
        self._start, self._read = start, boundary
        self._context_text = context
        self._sent = sent

    def _splits_run(self, boundary: int) -> bool:
        ids, i, j = self.ids, boundary - 1, boundary
        while i > self._start and ids[i] in self._in_run and ids[i] not in self._bytes:
            i -= 1
        while j < len(ids) - 1 and ids[j] in self._in_run and ids[j] not in self._bytes:
            j += 1
        return ids[i] in self._bytes and ids[j] in self._bytes

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
