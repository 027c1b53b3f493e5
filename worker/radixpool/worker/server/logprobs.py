"""Token logprobs in the two OpenAI shapes (chat `content[]` and legacy completions arrays)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from radixpool.tokenization import PromptTokenizer

MIN_LOGPROB = -9999.0   # JSON has no -inf; OpenAI clamps the same way
TopLogprobs = Sequence[Sequence[tuple[int, float]]]


def _finite(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


class TokenText:
    """Each token id's own text (what OpenAI puts in `token`), decoded once and remembered."""

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def chat_logprobs(token_text: TokenText, token_ids: Sequence[int], logprobs: Sequence[float],
                  top: TopLogprobs | None) -> dict:
    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=False)):
        text = token_text(token_id)
        alternatives = top[i] if top and i < len(top) else ()
        content.append({
            "token": text,
            "logprob": _finite(logprob),
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": (t := token_text(alt)), "logprob": _finite(lp), "bytes": list(t.encode())}
                for alt, lp in alternatives
            ],
        })
    return {"content": content}


def completion_logprobs(token_text: TokenText, token_ids: Sequence[int],
                        logprobs: Sequence[float], top: TopLogprobs | None,
                        offset: int = 0) -> tuple[dict, int]:
    """The legacy shape, and the text offset just after these tokens (for the next chunk)."""
    tokens, offsets = [], []
    for token_id in token_ids[: len(logprobs)]:
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top_maps = None
    if top is not None:
        top_maps = [{token_text(alt): _finite(lp) for alt, lp in alternatives}
                    for alternatives in top[: len(tokens)]]
    doc = {
        "tokens": tokens,
        "token_logprobs": [_finite(lp) for lp in logprobs[: len(tokens)]],
        "top_logprobs": top_maps,
        "text_offset": offsets,
    }
    return doc, offset
