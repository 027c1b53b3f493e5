"""The feature mix of `gpu_soak.py`: which requests carry which sampling feature, and the check of
each finished one.

Features (`FEATURES`), each a share of the soak's requests:
- json / regex: a grammar constraint from a small fixed set (compiled once, then cached). A
  request that ends with "stop" must parse and validate against its schema / fullmatch its regex;
  one cut by its token limit is counted apart, unchecked.
- penalties: repetition / frequency / presence penalties (the loop reads tokens on the host before
  scheduling ahead); it must end with exactly `max_new_tokens` tokens (EOS is ignored).
- logprobs: one logprob per output token, top-k lists of the asked length, all finite and ≤ 0;
  the chosen token's logprob is at most the largest of the top ones, and under greedy sampling
  equal to it.
- stop: stop strings and stop token ids, applied as the engine front end applies them
  (`RequestOutput`: text trimmed before the first completed stop, the core told to stop). The
  returned text contains none of the stop strings; a stop-token finish ends on one of them.
- seeded: pairs of identical seeded requests sent some steps apart (so in other batches). A
  mismatch is counted, not failed: GPU numerics may depend on the batch.
n > 1 is not here: the core takes one choice per request, the engine front end fans `n` out.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from radixpool.tokenization import PromptTokenizer
from radixpool.worker.detokenizer import IncrementalDetokenizer
from radixpool.worker.messages import TokenDelta
from radixpool.worker.request_output import RequestOutput
from radixpool.worker.sampler import request_seed
from radixpool.worker.sampling_params import SamplingParams
from radixpool.worker.stop_strings import StopMatcher

FEATURES = ("json", "regex", "penalties", "logprobs", "stop", "seeded")
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "size", "color", "ok"],
     "properties": {"name": {"type": "string", "maxLength": 8},
                    "size": {"type": "integer", "minimum": 1, "maximum": 500},
                    "color": {"enum": ["red", "green", "blue"]},
                    "ok": {"type": "boolean"}}},
    {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
     "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                    "tags": {"type": "array", "minItems": 1, "maxItems": 3,
                             "items": {"enum": ["cache", "radix", "tree"]}}}},
]
REGEXES = [r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
           r"\+1 [0-9]{3}-[0-9]{3}-[0-9]{4}"]
STOPS = ["the", "e ", "s", "an", ".", "!", "ou", "\n", "r"]
CONSTRAINED_MAX_TOKENS = 256   # the schemas' longest outputs take far fewer tokens
LOGPROB_TOLERANCE = 1e-3


def missing_packages() -> dict[str, str]:
    """{feature: the package it needs that is not installed} (grammars compile with xgrammar,
    JSON outputs are checked with jsonschema)."""
    missing = {}
    for feature, packages in (("json", ("xgrammar", "jsonschema")), ("regex", ("xgrammar",))):
        absent = [name for name in packages if importlib.util.find_spec(name) is None]
        if absent:
            missing[feature] = " and ".join(absent)
    return missing


def write_tokenizer(model_dir: Path, chat_template: str | None = None) -> int:
    """Give a random-weight model dir the tiny model's tokenizer (grammars and text need one),
    with `chat_template` when given (the chat routes need one); returns its vocabulary size.
    Its special tokens are ids 0-4: <s> is 1 and </s> is 2."""
    from radixpool.worker.tiny_model import train_tokenizer

    tok = train_tokenizer(0)
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "pad_token": "<pad>", "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


@dataclass
class Tracked:
    feature: str
    params: SamplingParams
    output: RequestOutput
    prompt: list[int]
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: int = 0
    reason: str | None = None
    matched: str | int | None = None
    failed: bool = False   # one violation per request is enough
    error: str | None = None   # why the core ended it, when it refused it


class FeatureMix:
    """Chooses each request's feature and checks what came back. `share` of requests get one."""

    def __init__(self, features: list[str], model_dir: Path, vocab: int, text_vocab: int,
                 rng: random.Random, share: float = 0.5) -> None:
        self.features, self.rng, self.share = features, rng, share
        self.tokenizer = PromptTokenizer.from_dir(model_dir)
        # Where the model's vocabulary is larger than the tokenizer's, stop-string requests
        # favour the tokens that have text (else a stop string would almost never show up).
        self.text_bias = {t: 50.0 for t in range(5, text_vocab)} if vocab > text_vocab else {}
        self.tracked: dict[str, Tracked] = {}
        self.counts: dict[str, Counter] = {f: Counter() for f in features}
        self.violations: list[str] = []
        self.twins: list[tuple[int, str]] = []   # (send at step, rid of the first of the pair)
        self.pairs: dict[str, str] = {}          # second rid -> first rid

    def pick(self) -> str | None:
        if not self.features or self.rng.random() >= self.share:
            return None
        return self.rng.choice(self.features)

    def params(self, feature: str) -> SamplingParams:
        rng = self.rng
        if feature == "json":
            return SamplingParams(max_new_tokens=CONSTRAINED_MAX_TOKENS, temperature=1.0,
                                  json_schema=json.dumps(rng.choice(SCHEMAS)))
        if feature == "regex":
            return SamplingParams(max_new_tokens=CONSTRAINED_MAX_TOKENS, temperature=1.0,
                                  regex=rng.choice(REGEXES))
        if feature == "penalties":
            return SamplingParams(max_new_tokens=rng.randint(1, 128), ignore_eos=True,
                                  temperature=rng.choice([0.0, 0.8]),
                                  repetition_penalty=rng.choice([1.0, 1.1, 1.5]),
                                  frequency_penalty=rng.choice([0.0, 0.5, 1.5]),
                                  presence_penalty=rng.choice([0.0, -0.5, 1.0]))
        if feature == "logprobs":
            return SamplingParams(max_new_tokens=rng.randint(1, 64), ignore_eos=True,
                                  temperature=rng.choice([0.0, 0.8]), logprobs=rng.randint(0, 5))
        if feature == "stop":
            return SamplingParams(max_new_tokens=rng.randint(8, 128), ignore_eos=True,
                                  temperature=0.8, stop=tuple(rng.sample(STOPS, 2)),
                                  stop_token_ids=tuple(rng.sample(range(10, 1000), 3)),
                                  logit_bias=self.text_bias)
        return SamplingParams(max_new_tokens=rng.randint(16, 64), ignore_eos=True,
                              temperature=0.9, top_p=0.95, seed=rng.randrange(1 << 30))

    def track(self, rid: str, feature: str, params: SamplingParams, prompt: list[int],
              step: int) -> int:
        """Start following a request; returns the seed the core should get."""
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                       [t for t in prompt if t < self.tokenizer.vocab_size])
        stop = StopMatcher(params.stop) if params.stop else None
        output = RequestOutput(rid, rid, 0, params, detok, stop, lambda _: None, time.time())
        self.tracked[rid] = Tracked(feature, params, output, prompt)
        self.counts[feature]["sent"] += 1
        if feature == "seeded" and rid not in self.pairs:
            self.twins.append((step + self.rng.randint(5, 60), rid))
        return request_seed(params.seed)

    def due_twins(self, step: int, next_rid: int) -> list[tuple[str, list[int], SamplingParams]]:
        """(rid, prompt, params) of the seeded twins to send now, numbered from `next_rid`."""
        due = [first for at, first in self.twins if at <= step]
        self.twins = [(at, first) for at, first in self.twins if at > step]
        out = []
        for i, first in enumerate(due):
            rid = f"r{next_rid + i}"
            self.pairs[rid], self.pairs[first] = first, rid
            out.append((rid, self.tracked[first].prompt, self.tracked[first].params))
        return out

    def on_delta(self, delta: TokenDelta) -> bool:
        """Follow one delta; True when the request is over (by the core, or by a stop string:
        then the caller aborts it in the core, as the engine does)."""
        t = self.tracked.get(delta.rid)
        if t is None:
            return delta.finished
        chunk, _ = t.output.apply(delta)
        t.text += chunk.text
        t.tokens += delta.token_ids
        if t.feature == "logprobs" and delta.error is None:
            self._check_logprobs(delta, t)
        if chunk.finished:
            t.reason, t.matched = chunk.finish_reason, chunk.matched_stop
            t.error = delta.error
            self._finish(delta.rid, t)
        return chunk.finished

    def aborted(self, rid: str) -> None:
        t = self.tracked.get(rid)
        if t is not None and t.reason is None:
            t.reason = "abort"
            self.counts[t.feature]["aborted"] += 1

    def _violation(self, rid: str, t: Tracked, what: str) -> None:
        if t.failed:
            return
        t.failed = True
        constraint = t.params.constraint or (t.params.stop, t.params.stop_token_ids)
        self.violations.append(f"{t.feature} {rid}: {what}; text {t.text!r}, "
                               f"constraint {constraint!r}")

    def _check_logprobs(self, delta: TokenDelta, t: Tracked) -> None:
        n, want = len(delta.token_ids), t.params.logprobs
        lps, tops = delta.logprobs or [], delta.top_logprobs or []
        if len(lps) != n or len(tops) != n:
            return self._violation(delta.rid, t, f"{n} tokens, {len(lps)} logprobs, "
                                                 f"{len(tops)} top lists")
        t.logprobs += n
        for lp, top in zip(lps, tops):
            values = [lp] + [v for _, v in top]
            if len(top) != want or not all(math.isfinite(v) and v <= LOGPROB_TOLERANCE
                                           for v in values):
                return self._violation(delta.rid, t, f"logprob {lp}, top {top} (asked {want})")
            best = max((v for _, v in top), default=lp)
            # the top ones are the largest; greedy sampling chose the largest of all
            if lp > best + LOGPROB_TOLERANCE or (t.params.greedy and
                                                 lp < best - LOGPROB_TOLERANCE):
                return self._violation(delta.rid, t, f"chose logprob {lp} with top {top} "
                                                     f"(greedy: {t.params.greedy})")

    def _finish(self, rid: str, t: Tracked) -> None:
        c, p = self.counts[t.feature], t.params
        c["finished"] += 1
        if t.reason == "abort":   # refused by the core, or lost: never expected here
            return self._violation(rid, t, f"finished with abort ({t.error})")
        if t.feature in ("json", "regex"):
            if t.reason == "length":
                c["cut by length"] += 1
                return
            c["complete"] += 1
            error = _json_error(t.text, p.json_schema) if t.feature == "json" else \
                None if re.fullmatch(p.regex, t.text) else "no fullmatch"
            if error:
                return self._violation(rid, t, f"invalid output ({error})")
            c["valid"] += 1
        elif t.feature in ("penalties", "logprobs") and len(t.tokens) != p.max_new_tokens:
            self._violation(rid, t, f"{len(t.tokens)} tokens, asked {p.max_new_tokens}")
        elif t.feature == "logprobs" and t.logprobs != len(t.tokens):
            self._violation(rid, t, f"{t.logprobs} logprobs for {len(t.tokens)} tokens")
        elif t.feature == "stop":
            kind = ("stop string" if isinstance(t.matched, str) else
                    "stop token" if t.reason == "stop" else t.reason)
            c[f"by {kind}"] += 1
            if any(s in t.text for s in p.stop):
                self._violation(rid, t, f"stop string left in the text (finished by {kind})")
            elif kind == "stop token" and t.tokens[-1] not in p.stop_token_ids:
                self._violation(rid, t, f"stop-token finish on token {t.tokens[-1]}")
        elif t.feature == "seeded" and rid in self.pairs:
            other = self.tracked.get(self.pairs[rid])   # None: the twin is not sent yet
            if other is not None and other.reason not in (None, "abort"):
                c["pairs"] += 1
                c["matched"] += other.tokens == t.tokens

    def summary(self) -> list[str]:
        lines = []
        for feature in self.features:
            c = self.counts[feature]
            order = {"json": ["complete", "valid", "cut by length"],
                     "regex": ["complete", "valid", "cut by length"],
                     "stop": ["by stop string", "by stop token", "by length"],
                     "seeded": ["pairs", "matched"]}.get(feature, ["finished"])
            parts = [f"{c['sent']} sent"] + [f"{c[k]} {k}" for k in order]
            lines.append(f"{feature}: {', '.join(parts)}, {c['aborted']} aborted")
        return lines


def _json_error(text: str, schema: str) -> str | None:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), json.loads(schema))
    except (ValueError, jsonschema.ValidationError) as exc:
        return str(exc).splitlines()[0][:160]
    return None
