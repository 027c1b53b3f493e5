"""Token logprobs in the two OpenAI shapes (chat `content[]` and legacy completions arrays).

A token may hold part of a character (a byte-level BPE splits "🎉" over several tokens; a
byte-fallback model spells it as `<0xF0>`...). Such a token's `bytes` are its own bytes, so the
`bytes` of a reply's tokens join to its text's UTF-8, and its `token` is spelled `bytes:\\xf0`
as OpenAI spells it (never U+FFFD: two different byte tokens would read the same).

The entries cover exactly a reply's text (`TextCover`): a stop string cuts the text inside its
tokens, and a stream holds text back while it may begin one, so the entries are held with it.
"""

from __future__ import annotations

import codecs
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from radixpool.tokenization import PromptTokenizer

MIN_LOGPROB = -9999.0   # JSON has no -inf; OpenAI clamps the same way
TopLogprobs = Sequence[Sequence[tuple[int, float]]]
REPLACEMENT = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """How byte-level BPE vocabularies spell bytes: a byte that is a visible Latin-1 character
    is that character, the others (controls, space, ...) are chr(256 + k) in byte order."""
    visible = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in visible}
    hidden = [b for b in range(256) if chr(b) not in alphabet]
    alphabet.update((chr(256 + k), b) for k, b in enumerate(hidden))
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


class TokenText:
    """Each token id as OpenAI shows it: `(token, bytes)`, worked out once and remembered.

    A token is decoded after an anchor token ("a") and the anchor's text cut off: decoded alone,
    a SentencePiece token loses the leading space its `▁` stands for."""

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        self._anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
        self._anchor_text = tokenizer.decode(self._anchor, skip_special_tokens=False)

    def skipped(self, skip_special_tokens: bool,
                trimmed_stop_token: int | None = None) -> frozenset[int]:
        """The token ids a request's text leaves out: the special tokens unless shown, and the
        stop token whose text was trimmed. That one is the output's last token and occurs
        nowhere before it (a stop token ends the output, and is banned until `min_new_tokens`),
        so leaving its id out leaves out that one token."""
        skipped = self.tokenizer.special_ids if skip_special_tokens else frozenset()
        return skipped if trimmed_stop_token is None else skipped | {trimmed_stop_token}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        known = self._cache.get(token_id)
        if known is None:
            known = self._cache[token_id] = self._spell(token_id)
        return known

    def _spell(self, token_id: int) -> tuple[str, bytes]:
        text = self.tokenizer.decode([*self._anchor, token_id], skip_special_tokens=False)
        text = text[len(self._anchor_text):]
        if REPLACEMENT not in text:
            return text, text.encode()
        raw = self._own_bytes(token_id)
        if raw is None:   # a token whose text really is U+FFFD
            return text, text.encode()
        return spell_bytes(raw), raw

    def _own_bytes(self, token_id: int) -> bytes | None:
        piece = self.tokenizer.tokenizer.id_to_token(token_id)
        if piece is None:
            return None
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback[1], 16)])
        if all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return None


def spell_bytes(raw: bytes) -> str:
    """A token's bytes as OpenAI spells them: its text, or `bytes:\\xf0` when they are no text."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def finite_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf (a token the model gave no mass) is MIN_LOGPROB."""
    return value if math.isfinite(value) else MIN_LOGPROB


class TokenEntry(NamedTuple):
    """One token's logprob entry, spelled as OpenAI shows it."""

    token_id: int
    token: str
    raw: bytes
    logprob: float
    top: Sequence[tuple[int, float]]
    in_text: bool   # False: a token the text leaves out (a skipped special token, a stop token)


class TextCover:
    """The entries of one choice's tokens that its text covers so far, each handed out once.

    A stream holds back text that may begin a stop string (and the bytes of an unfinished
    character), so a token's entry goes out once the text spells it whole: tokens are counted in
    characters as the text counts them (their bytes decoded, U+FFFD for bytes that are no
    character), up to a token that ends a character. At the end every token goes out, unless the
    text ends inside its tokens' text (`cut`: a stop string ended it): the tokens past the cut
    are dropped, and the one the cut goes through keeps the part of its bytes in the text (and
    its logprobs). So the entries' `bytes` join to the text however it was chunked, and a stream's
    entries are the whole answer's.
    """

    def __init__(self, token_text: TokenText) -> None:
        self.token_text = token_text
        self._pending: list[tuple[int, float, Sequence[tuple[int, float]]]] = []
        self._covered = 0   # characters of the text that the handed-out tokens spell
        self._chars = 0     # characters of the text so far

    def take(self, token_ids: Sequence[int], logprobs: Sequence[float], top: TopLogprobs | None,
             text: str, skipped: frozenset[int], end: bool = False,
             cut: bool = False) -> list[TokenEntry]:
        """Add a chunk (its tokens and its text); return the entries the text now covers. `end`:
        the choice's last chunk; `skipped`: the token ids the text leaves out."""
        self._pending += ((token_id, logprob, top[i] if top and i < len(top) and top[i] else ())
                          for i, (token_id, logprob)
                          in enumerate(zip(token_ids, logprobs, strict=False)))
        self._chars += len(text)
        if end and not cut:
            ready, self._pending = self._pending, []
            return [self._entry(*item, skipped) for item in ready]
        entries = self._whole(skipped)
        if end:
            entries += self._straddling(skipped)
            self._pending = []
        return entries

    def _whole(self, skipped: frozenset[int]) -> list[TokenEntry]:
        decoder = _utf8_decoder()
        chars, ready, covered = self._covered, 0, self._covered
        for k, (token_id, _, _) in enumerate(self._pending, 1):
            chars += len(decoder.decode(self._bytes(token_id, skipped)))
            if chars > self._chars:
                break
            if not decoder.getstate()[0]:   # no character left open: the text holds it all
                ready, covered = k, chars
        done, self._pending, self._covered = self._pending[:ready], self._pending[ready:], covered
        return [self._entry(*item, skipped) for item in done]

    def _straddling(self, skipped: frozenset[int]) -> list[TokenEntry]:
        """At a cut: the tokens that spell the text's last characters, the last one cut to the
        bytes the text holds."""
        decoder = _utf8_decoder()
        chars, entries = self._covered, []
        for token_id, logprob, top in self._pending:
            raw = self._bytes(token_id, skipped)
            open_bytes = decoder.getstate()[0]
            if open_bytes and raw and not _continues(open_bytes, raw[:1]):
                # the character the tokens before began never completes: theirs is its U+FFFD
                chars += len(decoder.decode(b"", final=True))
                decoder.reset()
            if chars >= self._chars:
                break
            state, got = decoder.getstate(), 0
            for size in range(1, len(raw) + 1):
                decoder.setstate(state)
                got = len(decoder.decode(raw[:size]))
                if chars + got >= self._chars:
                    last = self._entry(token_id, logprob, top, skipped)
                    if size < len(raw):
                        last = last._replace(token=spell_bytes(raw[:size]), raw=raw[:size])
                    return [*entries, last]
            chars += got
            entries.append(self._entry(token_id, logprob, top, skipped))
        return entries

    def _bytes(self, token_id: int, skipped: frozenset[int]) -> bytes:
        return b"" if token_id in skipped else self.token_text(token_id)[1]

    def _entry(self, token_id: int, logprob: float, top: Sequence[tuple[int, float]],
               skipped: frozenset[int]) -> TokenEntry:
        token, raw = self.token_text(token_id)
        return TokenEntry(token_id, token, raw, logprob, top, token_id not in skipped)


def _utf8_decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")("replace")


def chat_logprobs(token_text: TokenText, entries: Sequence[TokenEntry]) -> dict:
    """`content`: one entry per token of the message. A token the text leaves out (the special
    tokens, unless the request shows them), such as the end-of-turn token that ended the output,
    is no part of it and gets none, as in OpenAI's answers."""
    return {"content": [{
        "token": entry.token,
        "logprob": finite_logprob(entry.logprob),
        "bytes": list(entry.raw),
        "top_logprobs": [
            {"token": (spelled := token_text(alt))[0], "logprob": finite_logprob(lp),
             "bytes": list(spelled[1])}
            for alt, lp in entry.top
        ],
    } for entry in entries if entry.in_text]}


@dataclass
class TextOffset:
    """Where the next token starts in a completion's text, in characters (a token that begins
    inside a character starts where that character does): carried from chunk to chunk."""

    chars: int = 0
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def advance(self, raw: bytes) -> int:
        """This token's offset; the offset moves past the characters it completes."""
        pending = self.decoder.getstate()[0]
        if pending and raw and not _continues(pending, raw[:1]):
            # the character begun before this token never completes: it reads U+FFFD there
            self.chars += len(self.decoder.decode(b"", final=True))
            self.decoder.reset()
        at = self.chars
        self.chars += len(self.decoder.decode(raw))
        return at


def _continues(pending: bytes, byte: bytes) -> bool:
    """Whether `byte` may follow `pending`, the unfinished start of a UTF-8 character."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(pending + byte)
    except UnicodeDecodeError:
        return False
    return True


def completion_logprobs(token_text: TokenText, entries: Sequence[TokenEntry],
                        offset: TextOffset | None = None) -> tuple[dict, TextOffset]:
    """The legacy shape, and the text offset just after these tokens (for the next chunk). A
    token the text leaves out is listed where the text goes on, taking no room."""
    offset = offset or TextOffset()
    doc = {
        "tokens": [entry.token for entry in entries],
        "token_logprobs": [finite_logprob(entry.logprob) for entry in entries],
        "top_logprobs": [{token_text(alt)[0]: finite_logprob(lp) for alt, lp in entry.top}
                         for entry in entries],
        "text_offset": [offset.advance(entry.raw) if entry.in_text else offset.chars
                        for entry in entries],
    }
    return doc, offset
