"""One request's grammar state, and jump-forward.

The matcher has accepted every token of the request's output. After it accepts a sampled token,
the grammar may force the next run of text (`{"name": "` after `{`): that text is appended
without a forward pass per token. The sampled token has no KV yet (it is the next step's input),
so it can still be re-split: the forced text is tokenized *together with it*, the way the
tokenizer splits the joined text (`"` then forced `name": ` may become `"name`, `":`, ` `), and
the result replaces it. Tokens that already have KV are never re-split. A re-tokenization is used
only if its tokens spell exactly the bytes of sampled token + forced text, contain no masked
special token, and the grammar accepts them; otherwise the forced text is tokenized on its own
after the sampled token, and if that fails too, nothing is forced.
"""

from __future__ import annotations

import contextlib

from radixpool.worker.grammar.compiler import CompiledGrammar, ModelVocab


class RequestGrammar:
    __slots__ = ("failure", "matcher", "may_jump", "vocab")

    def __init__(self, compiled: CompiledGrammar, vocab: ModelVocab) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled.grammar)
        self.vocab = vocab
        # False for a constraint that may force a long run (`forced_length`): asking xgrammar
        # for it could take minutes and gigabytes; its tokens are decoded one by one instead.
        self.may_jump = compiled.may_jump
        # What the grammar library raised on this request (filling its mask): the request is
        # ended with it when its step is processed; the others in the batch go on.
        self.failure: Exception | None = None

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def forced_text(self, max_tokens: int) -> str:
        """The text the grammar forces next ("" when none), cut to what `max_tokens` tokens can
        spell: a 10-character regex `a{10000000}` forces ten million characters, whose
        tokenization held the engine's step for seconds when only a few tokens were wanted.
        xgrammar hands it over as a Python str and fails when it starts inside a UTF-8
        character (the output so far ends with part of one, e.g. the first byte token of an
        emoji a pattern spells out): nothing is forced then, and the character's remaining
        bytes are decoded one token at a time."""
        if not self.may_jump:
            return ""
        try:
            forced = self.matcher.find_jump_forward_string()
        except UnicodeDecodeError:
            return ""
        return forced[:max_tokens * self.vocab.longest_token]   # a character is ≥ 1 byte

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return self.matcher.is_terminated()

    def jump_forward(self, last: int, budget: int) -> list[int] | None:
        """Tokens to put in place of `last` (accepted, no KV yet): `last` followed by the text
        the grammar forces next, at most `budget` (≥ 1) tokens; the matcher accepts them. None
        when nothing is forced or no tokenization of it fits. One token can be the answer: the
        joined text may be a single token other than `last`."""
        forced = self.forced_text(budget)
        if not forced:
            return None
        vocab = self.vocab
        head = vocab.decoded[last]
        want = head + forced.encode()
        candidates = []
        # (`last` may end inside a UTF-8 character: then it cannot be re-split as text)
        with contextlib.suppress(UnicodeDecodeError):
            candidates.append(vocab.encode(head.decode() + forced))
        candidates.append([last, *vocab.encode(forced)])
        for ids in candidates:
            if ids == [last] or b"".join(vocab.decoded[i] for i in ids) != want or \
                    vocab.banned.intersection(ids):
                continue
            ids = ids[:budget]
            if self._replace_last(last, ids):
                return ids
        return None

    def _replace_last(self, last: int, ids: list[int]) -> bool:
        """Roll `last` back and accept `ids` instead; on refusal, leave the matcher as it was."""
        m = self.matcher
        m.rollback(1)
        for n, token in enumerate(ids):
            if not m.accept_token(token):
                if n:
                    m.rollback(n)
                m.accept_token(last)
                return False
        return True
