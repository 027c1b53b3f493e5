"""Token logprobs in the two OpenAI shapes (chat `content[]` and legacy completions arrays).

A token may hold part of a character (a byte-level BPE splits "🎉" over several tokens; a
byte-fallback model spells it as `<0xF0>`...). Such a token's `bytes` are its own bytes, so the
`bytes` of a reply's tokens join to its text's UTF-8, and its `token` is spelled `bytes:\\xf0`
as OpenAI spells it (never U+FFFD: two different byte tokens would read the same).
"""

from __future__ import annotations

import codecs
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

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
        try:
            return raw.decode(), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

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


def finite_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf (a token the model gave no mass) is MIN_LOGPROB."""
    return value if math.isfinite(value) else MIN_LOGPROB


def chat_logprobs(token_text: TokenText, token_ids: Sequence[int], logprobs: Sequence[float],
                  top: TopLogprobs | None, skipped: frozenset[int] = frozenset()) -> dict:
    """`content`: one entry per token of the message. A token the text leaves out (`skipped`:
    the special tokens, unless the request shows them), such as the end-of-turn token that ended
    the output, is no part of it and gets none, as in OpenAI's answers."""
    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=False)):
        if token_id in skipped:
            continue
        text, raw = token_text(token_id)
        alternatives = top[i] if top and i < len(top) else ()
        content.append({
            "token": text,
            "logprob": finite_logprob(logprob),
            "bytes": list(raw),
            "top_logprobs": [
                {"token": (spelled := token_text(alt))[0], "logprob": finite_logprob(lp),
                 "bytes": list(spelled[1])}
                for alt, lp in alternatives
            ],
        })
    return {"content": content}


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


def completion_logprobs(token_text: TokenText, token_ids: Sequence[int],
                        logprobs: Sequence[float], top: TopLogprobs | None,
                        offset: TextOffset | None = None,
                        skipped: frozenset[int] = frozenset()) -> tuple[dict, TextOffset]:
    """The legacy shape, and the text offset just after these tokens (for the next chunk). A
    token the text leaves out (`skipped`) is listed where the text goes on, taking no room."""
    offset = offset or TextOffset()
    tokens, offsets = [], []
    for token_id in token_ids[: len(logprobs)]:
        text, raw = token_text(token_id)
        tokens.append(text)
        offsets.append(offset.chars if token_id in skipped else offset.advance(raw))
    top_maps = None
    if top is not None:
        top_maps = [{token_text(alt)[0]: finite_logprob(lp) for alt, lp in alternatives}
                    for alternatives in top[: len(tokens)]]
    doc = {
        "tokens": tokens,
        "token_logprobs": [finite_logprob(lp) for lp in logprobs[: len(tokens)]],
        "top_logprobs": top_maps,
        "text_offset": offsets,
    }
    return doc, offset
