"""Per-request sampling parameters, validated when the request arrives.

Every error is a `ValueError` that names the offending field, so the server can turn it into a
400 with a message the client can act on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

GREEDY_TEMPERATURE = 1e-5  # below this, logits / T overflows float32 for ordinary logits
# A positive logit is divided by the repetition penalty: below this it is a 100-fold boost that no
# use needs, and near float32's smallest normal (1e-38) the quotient overflows and the request
# ends in non-finite logits (found by the fuzz test: 5e-324).
MIN_REPETITION_PENALTY = 0.01
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf")
MAX_CONSTRAINT_CHARS = 100_000   # compiles run one at a time: a huge grammar would hold the rest

# Fields a model's generation_config.json may give defaults for (vLLM's and SGLang's list).
MODEL_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def over_model_defaults(doc: Any, defaults: dict[str, Any]) -> Any:
    """A request's sampling fields over the model's `defaults` (its generation_config.json
    fields): what it leaves out takes them. A `doc` of another type is left for `from_dict`
    to refuse, naming it."""
    if defaults and (doc is None or isinstance(doc, dict)):
        return {**defaults, **(doc or {})}
    return doc


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1                   # -1 (or 0) disables
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()        # stop strings: matched on text by the front end
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False        # keep the matched stop string / stop token's text
    n: int = 1
    logprobs: int | None = None       # None: no logprobs; k >= 0: chosen token + top k
    skip_special_tokens: bool = True
    # Structured output (at most one): the output must match this grammar (grammar/ package).
    json_schema: str | None = None    # a JSON schema, as JSON text (an object is dumped)
    regex: str | None = None
    ebnf: str | None = None

    @classmethod
    def from_dict(cls, doc: dict[str, Any] | None) -> SamplingParams:
        """Build from a JSON-like dict; unknown fields and bad types raise ValueError."""
        if doc is not None and not isinstance(doc, dict):
            raise ValueError(f"sampling_params must be an object, got {type(doc).__name__}")
        doc = dict(doc or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ValueError(f"unknown sampling field {unknown[0]!r}; "
                             f"expected one of: {', '.join(sorted(known))}")
        if doc.get("logit_bias") is not None:
            doc["logit_bias"] = _parse_logit_bias(doc["logit_bias"])
        if isinstance(doc.get("json_schema"), dict):
            doc["json_schema"] = json.dumps(doc["json_schema"])
        for name in [k for k, v in doc.items() if v is None and k not in ("seed", "logprobs")]:
            doc.pop(name)
        return cls(**doc)

    def __post_init__(self) -> None:
        # Lists from JSON become tuples (the params are immutable), and one string becomes one
        # stop: a str is never iterated as a sequence of one-character stops.
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, str) and name == "stop":
                object.__setattr__(self, name, (value,))
            elif isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
            elif not isinstance(value, tuple):
                kind = "a string or a list of strings" if name == "stop" else "a list of token ids"
                raise ValueError(f"{name} must be {kind}, got {value!r}")

        def check_type(name: str, kinds: tuple[type, ...], label: str) -> None:
            value = getattr(self, name)
            if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
                raise ValueError(f"{name} must be {label}, got {value!r}")

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            check_type(name, (int,), "an integer")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            check_type(name, (int, float), "a number")
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)!r}")
        for name in ("ignore_eos", "no_stop_trim", "skip_special_tokens"):
            check_type(name, (bool,), "true or false")
        if self.seed is not None:
            check_type("seed", (int,), "an integer")
        if self.logprobs is not None:
            check_type("logprobs", (int,), "an integer")

        def fail(name: str, expected: str) -> None:
            raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")

        if self.max_new_tokens < 1:
            fail("max_new_tokens", "≥ 1")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            fail("min_new_tokens", f"in [0, max_new_tokens={self.max_new_tokens}]")
        if self.temperature < 0:
            fail("temperature", "≥ 0")
        if not 0 < self.top_p <= 1:
            fail("top_p", "in (0, 1]")
        if self.top_k < -1:
            fail("top_k", "-1 (disabled) or ≥ 0")
        if not 0 <= self.min_p <= 1:
            fail("min_p", "in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                fail(name, "in [-2, 2]")
        if self.repetition_penalty < MIN_REPETITION_PENALTY:
            fail("repetition_penalty", f"≥ {MIN_REPETITION_PENALTY}")
        if self.n < 1:
            fail("n", "≥ 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            fail("logprobs", "in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "a non-empty string or a list of them")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0
               for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of non-negative token ids")
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be an object mapping token ids to biases, "
                             f"got {self.logit_bias!r}")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int):
                raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise ValueError(f"logit_bias[{token}] must be a number, got {bias!r}")
            if token < 0:
                raise ValueError(f"logit_bias token id must be ≥ 0, got {token}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {bias}")
        self._check_constraint()

    def _check_constraint(self) -> None:
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[0]} and {given[1]} were both given: a request takes at "
                             f"most one output constraint ({', '.join(CONSTRAINT_FIELDS)})")
        for name in given:
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
            if len(value) > MAX_CONSTRAINT_CHARS:
                raise ValueError(f"{name} has {len(value)} characters; at most "
                                 f"{MAX_CONSTRAINT_CHARS} are accepted")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
            except RecursionError:   # JSON text carried as a string skips the body's depth check
                raise ValueError("json_schema nests too deeply for the JSON parser") from None
            if not isinstance(schema, dict):
                raise ValueError(f"json_schema must be a JSON object (a schema), got "
                                 f"{self.json_schema[:80]!r}")

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, source) of the output constraint, if any: the grammar's compile-cache key."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Whether sampling reads the request's own past tokens."""
        return self.repetition_penalty != 1 or bool(self.frequency_penalty) or \
            bool(self.presence_penalty)

    @property
    def needs_host_tokens(self) -> bool:
        """Whether the next step's sampling needs this request's latest token on the host
        (penalties count it; a grammar's mask follows it)."""
        return self.penalised or self.constraint is not None

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in the params must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary "
                                 f"(size {vocab_size})")


def _parse_logit_bias(bias: Any) -> dict[int, float]:
    """JSON object keys are strings: accept "123" or 123 as a token id, a number as the bias."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to biases, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key) if isinstance(key, str) else key
        except ValueError:
            token = None
        if isinstance(token, bool) or not isinstance(token, int):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"logit_bias[{key}] must be a number, got {value!r}")
        out[token] = float(value)
    return out
