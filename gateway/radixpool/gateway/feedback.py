"""Ground truth from responses: what each answer says about the worker's cache.

A RadixPool or SGLang worker's response carries `prompt_tokens` and `cached_tokens` (OpenAI
`usage.prompt_tokens_details` or `/generate` `meta_info`). They are read with a byte regex over the
body or the SSE events, never a JSON parse of the whole answer. `first_missing_block` turns
(prediction, report) into "the first block the gateway believed cached that was not": `learn`
then trims that worker's tree.

An answer without `cached_tokens` (a vLLM server without prompt-token details, any
OpenAI-compatible server that leaves it out) says nothing about the cache: it is unknown, never
zero, and trims nothing. Such a worker's tree is then kept right by its KV events when it serves
them, and otherwise only by the tree's own LRU bound (`Worker.tree_source` says which).
"""

from __future__ import annotations

import re

from radixpool.gateway.metrics import GatewayMetrics
from radixpool.gateway.policies import Decision
from radixpool.gateway.prefix_index import PrefixIndex
from radixpool.gateway.route_key import BYTES_PER_TOKEN, RouteKey
from radixpool.gateway.workers import Worker

_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_USAGE_ONLY = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def usage_in(data: bytes) -> tuple[int, int | None] | None:
    """(prompt_tokens, cached_tokens) from the last report in `data`, if any; cached_tokens is
    None when the answer does not say (absent or null)."""
    prompts = _PROMPT.findall(data)
    if not prompts:
        return None
    cached = _CACHED.findall(data)
    return int(prompts[-1]), int(cached[-1]) if cached else None


def answer_usage(data: bytes) -> tuple[int, int | None, int, int] | None:
    """A non-streamed answer's report: (prompt_tokens, cached_tokens) of the prompt it was
    routed on, then the prompt and cached tokens of the other results of a `/generate` batch
    (a JSON array of results, in the order of its prompts; the route key is its first)."""
    if not data.lstrip().startswith(b"["):
        usage = usage_in(data)
        return None if usage is None else (*usage, 0, 0)
    prompts = [int(p) for p in _PROMPT.findall(data)]
    if not prompts:
        return None
    cached = [int(c) for c in _CACHED.findall(data)]
    if len(cached) != len(prompts):   # some result does not say: unknown, never zero
        return prompts[0], None, sum(prompts[1:]), 0
    return prompts[0], cached[0], sum(prompts[1:]), sum(cached[1:])


def is_usage_only_event(event: bytes) -> bool:
    """The final `stream_options.include_usage` event: no choices, only usage."""
    return b'"usage"' in event and _USAGE_ONLY.search(event) is not None


def predicted_tokens(decision: Decision, key: RouteKey, prompt_tokens: int,
                     page_size: int = 1) -> int:
    """What the tree predicted, in the worker's tokens (text-mode bytes scaled by the prompt).
    A worker recomputes at least the prompt's last token, and its matches are whole pages: a
    prompt cached whole reuses its tokens before the page that holds the last one."""
    units = decision.predicted_blocks * key.block_units
    if not key.exact:
        units = units * prompt_tokens // max(1, key.units)
    return min(units, max(0, prompt_tokens - 1) // page_size * page_size)


def prefill_wait(decision: Decision, key: RouteKey) -> tuple[int, float] | None:
    """(the prompt's last whole block, the uncached tokens the tree expects the worker to
    compute) for `Worker.prefill_sent`; None for a prompt shorter than one block."""
    if not key.hashes:
        return None
    units = key.units - decision.predicted_blocks * key.block_units
    return key.hashes[-1], max(0, units) / (1 if key.exact else BYTES_PER_TOKEN)


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


def learn(worker: Worker, index: PrefixIndex, metrics: GatewayMetrics, decision: Decision,
          key: RouteKey, prompt: int, cached: int | None, predicts: bool,
          others: tuple[int, int] = (0, 0)) -> None:
    """Take in one answer's report: the hit-rate counters, the worker's load estimate and, when
    the tree predicted more than the worker had, the trim of that worker's tree. `prompt` and
    `cached` are the routed prompt's; `others` the (prompt, cached) tokens of the rest of a
    batch, which only the counters and the load estimate take in."""
    page_size = 1 if worker.info is None else worker.info.page_size
    predicted = predicted_tokens(decision, key, prompt, page_size) if predicts else None
    if cached is None:
        worker.answered_unreported()
        worker.observe_uncached(prompt + others[0] - (predicted or 0))
        return
    worker.reports_cached = True
    worker.prompt_tokens += prompt + others[0]
    worker.cached_tokens += cached + others[1]
    worker.observe_uncached(prompt + others[0] - cached - others[1])
    if predicted is not None:
        worker.predicted_tokens += predicted
        missing = first_missing_block(decision, key, prompt, cached)
        if (missing is not None and missing < len(decision.prior_epochs)
                and not index.event_fed(worker.url)):   # (the KV events keep that tree)
            index.trim_through(worker.url, decision.prior_epochs[missing])
            worker.corrected("cached_tokens")
            metrics.corrected(worker.url, "cached_tokens")
    metrics.usage(worker.url, prompt + others[0], cached + others[1], predicted)
