"""Exact jump-forward: the text a grammar forces is a draft that one forward pass verifies.

After a request's sampled token, the grammar may force a run of text. Its canonical tokenization
d1..dk is only a guess at the tokens token-by-token decoding would pick (`{` then `"name` where
the model would pick `{"` then `name`), so it is not committed: the next step computes
[last token, d1..dk] in one extend and keeps the logits at every position. Position i's token is
chosen by the sampler exactly as token-by-token decoding would choose it there (the grammar's
mask after d1..d(i-1), the request's own processing and randomness at that step), and
`commit` accepts d(i+1) while it equals that choice; the first choice that differs is emitted
in its place and ends the run. Greedy: the masked argmax. Sampled: the sampler's draw at a step
is a function of (logits, params, seed, step) alone, so accepting d while the draw equals it
accepts d with probability p(d), and a rejection emits a draw from p with d removed: the
speculative-sampling rule for a one-point draft, and the same tokens as token by token with the
same seed. Every step emits at least one token, so it never takes more passes than "off".
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from radixpool.worker.grammar.matcher import RequestGrammar


def propose_draft(grammar: RequestGrammar, budget: int, stop_ids: Collection[int]) -> list[int]:
    """The canonical tokens of the text the grammar forces next, at most `budget`; cut before a
    stop or banned special token (an accepted draft token must never end the request) and at
    the first token the grammar refuses. The matcher is left as it was."""
    if budget <= 0:
        return []
    forced = grammar.forced_text(budget)
    if not forced:
        return []
    vocab = grammar.vocab
    draft: list[int] = []
    for token in vocab.encode(forced)[:budget]:
        if token in stop_ids or token in vocab.banned or not grammar.accept(token):
            break
        draft.append(token)
    if draft:
        grammar.matcher.rollback(len(draft))
    return draft


def commit(draft: Sequence[int], chosen: Sequence[int]) -> list[int]:
    """The tokens a verified draft emits. `chosen[i]` is the token chosen at position i of the
    extend (i = 0: after the last committed token; i ≥ 1: after d1..di), len(draft) + 1 of
    them: the accepted draft prefix, then the choice at the first mismatch (or after the whole
    draft)."""
    accepted = 0
    while accepted < len(draft) and chosen[accepted] == draft[accepted]:
        accepted += 1
    return [*draft[:accepted], chosen[accepted]]
