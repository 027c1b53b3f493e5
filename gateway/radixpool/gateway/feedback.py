"""Ground truth from responses: what each answer says about the worker's cache.

Every worker response carries `prompt_tokens` and `cached_tokens` (OpenAI `usage` or `/generate`
`meta_info`). They are read with a byte regex over the body or the SSE events, never a JSON parse
of the whole answer. `first_missing_block` turns (prediction, report) into "the first block the
gateway believed cached that was not": the proxy then trims that worker's tree.
"""

from __future__ import annotations

import re

from radixpool.gateway.policies import Decision
from radixpool.gateway.route_key import RouteKey

_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_USAGE_ONLY = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def usage_in(data: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, cached_tokens) from the last report in `data`, if any."""
    prompts = _PROMPT.findall(data)
    if not prompts:
        return None
    cached = _CACHED.findall(data)
    return int(prompts[-1]), int(cached[-1]) if cached else 0


def is_usage_only_event(event: bytes) -> bool:
    """The final `stream_options.include_usage` event: no choices, only usage."""
    return b'"usage"' in event and _USAGE_ONLY.search(event) is not None


def predicted_tokens(decision: Decision, key: RouteKey, prompt_tokens: int) -> int:
    """What the tree predicted, in the worker's tokens (text-mode bytes scaled by the prompt)."""
    units = decision.predicted_blocks * key.block_units
    if not key.exact:
        units = units * prompt_tokens // max(1, key.units)
    return min(units, max(0, prompt_tokens - 1))


def first_missing_block(decision: Decision, key: RouteKey, prompt_tokens: int,
                        cached_tokens: int) -> int | None:
    """Index of the first predicted block the worker did not have, or None when it had them.

    A worker never reuses the prompt's very last token (it must compute logits), and text-mode
    blocks are an estimate, so the last predicted block gets one block of slack.
    """
    predicted = decision.predicted_blocks
    if predicted == 0:
        return None
    if key.exact:
        held = cached_tokens // key.block_units
        covers_all = predicted * key.block_units >= prompt_tokens
    else:
        held = cached_tokens * key.units // max(1, prompt_tokens) // key.block_units
        covers_all = True
    if held >= predicted or (covers_all and held >= predicted - 1):
        return None
    return held
