"""Compiling constraints into xgrammar grammars: off the engine's step, once per distinct grammar.

`GrammarCompiler.submit((kind, source))` returns a future. Compiles run on background threads
(the engine core keeps stepping other requests meanwhile); the first one also builds the model's
`ModelVocab` (xgrammar's tokenizer info, each token's bytes, the special tokens to mask), once per
model. Two lanes, one thread each: constraints that may take long to compile (`looks_heavy`: an
object with many optional properties, whose compile time grows faster than their square, a
deeply nested schema, or a long source) go to their own, so one of them (800 optional
properties took 82 s) delays only the others like it, never the ordinary schemas of other
requests. Futures are cached by (kind, source), least recently used first out, so a repeated
schema compiles once; a failed compile is cached too (the same bad schema gets the same answer
at once).
Every constraint is lowered to EBNF and compiled as a grammar: JSON schemas by `json_schema.py`
(fixed separators, length-bounded strings mended), and no character class of any kind admits a
UTF-8-encoded surrogate (`surrogates.py`).
"""

from __future__ import annotations

import bisect
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from radixpool.protocol.metrics import GRAMMAR_COMPILE_BUCKETS
from radixpool.worker.grammar.forced_length import forces_long_text
from radixpool.worker.grammar.json_schema import json_schema_ebnf
from radixpool.worker.grammar.surrogates import exclude_surrogates

CACHE_ENTRIES = 256
# What makes a constraint go to the heavy lane: an object schema with this many properties not
# required (on the tiny test model 100 compiled in 0.4 s, 200 in 1.5 s, 400 in 8 s; a real
# vocabulary costs more), or a source this long.
HEAVY_OPTIONAL_PROPERTIES = 32
HEAVY_SOURCE_CHARS = 16384
# ... or a JSON schema nested deeper than this (JSON levels, two or so per schema level):
# xgrammar's schema converter takes time that grows faster than the square of the depth (100
# schema levels, 6 KB of text: 0.4 s; 200: 3 s; 240: 6.6 s), where a flat schema of the same
# size takes milliseconds.
HEAVY_NESTING = 64
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: Check failed: (...) is false: ".
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
KIND_NAMES = {"json_schema": "JSON schema", "regex": "regular expression",
               "ebnf": "EBNF grammar"}


class GrammarError(ValueError):
    """A constraint that does not compile; the message names the field and the problem."""


@dataclass(frozen=True)
class ModelVocab:
    """What grammars need to know about the model's tokenizer."""

    info: Any                   # xgrammar.TokenizerInfo
    decoded: list[bytes]        # the bytes each token id stands for
    banned: frozenset[int]      # special tokens a grammar never emits (stop tokens excepted)
    tokenizer: Any              # tokenizers.Tokenizer: re-tokenizes forced text
    longest_token: int          # the most bytes one token spells

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def load_vocab(model_path: str, vocab_size: int, stop_ids: tuple[int, ...]) -> ModelVocab:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_path)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                              stop_token_ids=list(stop_ids))
    special = set(hf.all_special_ids) | {i for i, t in hf.added_tokens_decoder.items()
                                         if t.special}
    banned = frozenset(i for i in special if i < vocab_size and i not in stop_ids)
    decoded = list(info.decoded_vocab)
    return ModelVocab(info, decoded, banned, hf.backend_tokenizer, max(map(len, decoded)))


def _matches_nothing(compiled: Any, vocab: ModelVocab) -> bool:
    """No token may start the output and the grammar cannot end where it starts (`root ::= root`,
    a class with every character excluded): the request would get an empty "stop" answer."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab.info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    return not bool(mask.any()) and not matcher.is_completed()


def looks_heavy(kind: str, source: str) -> bool:
    """Whether compiling (kind, source) may take long: a source over `HEAVY_SOURCE_CHARS`, or a
    JSON schema with an object of at least `HEAVY_OPTIONAL_PROPERTIES` optional properties, or
    nested over `HEAVY_NESTING` levels. (A schema that does not parse is not: its compile fails
    at once.)"""
    if len(source) > HEAVY_SOURCE_CHARS:
        return True
    if kind != "json_schema":
        return False
    try:
        stack = [(json.loads(source), 1)]
    except (ValueError, RecursionError):
        return False
    while stack:
        node, depth = stack.pop()
        if depth > HEAVY_NESTING:
            return True
        if isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
        elif isinstance(node, dict):
            properties, required = node.get("properties"), node.get("required")
            if isinstance(properties, dict):
                named = set(required) if isinstance(required, list) and all(
                    isinstance(r, str) for r in required) else set()
                if len(properties.keys() - named) >= HEAVY_OPTIONAL_PROPERTIES:
                    return True
            stack.extend((value, depth + 1) for value in node.values())
    return False


@dataclass(frozen=True)
class CompiledGrammar:
    grammar: Any       # xgrammar's compiled grammar
    may_jump: bool     # False when it may force a long run (`forced_length`): no jump-forward


def _clean(exc: Exception) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _NOISE.sub("", lines[0] if lines else type(exc).__name__)


class GrammarCompiler:
    def __init__(self, model_path: str, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.vocab: ModelVocab | None = None    # set by a compile thread on first use
        self._vocab_lock = threading.Lock()
        self._lane_compiler = threading.local()   # each lane's thread has its own xgrammar one
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="radixpool-grammar")
        self._heavy = ThreadPoolExecutor(1, thread_name_prefix="radixpool-grammar-heavy")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        # compile-time histogram (cumulative per GRAMMAR_COMPILE_BUCKETS bound, then +Inf)
        self.compile_counts = [0] * (len(GRAMMAR_COMPILE_BUCKETS) + 1)
        self.compile_seconds_sum = 0.0
        self.cache_hits = 0

    def submit(self, key: tuple[str, str]) -> Future:
        """The compiled grammar of (kind, source), maybe still compiling."""
        fut = self._cache.get(key)
        if fut is not None:
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return fut
        lane = self._heavy if looks_heavy(*key) else self._executor
        fut = lane.submit(self._compile, key)
        self._cache[key] = fut
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return fut

    def call_off(self, key: tuple[str, str], fut: Future) -> None:
        """No request waits for `fut` (the compile of `key`) any more: cancelled, and forgotten,
        if it has not started; one under way goes on and stays cached."""
        if fut.cancel() and self._cache.get(key) is fut:
            del self._cache[key]

    def prepare(self) -> Future:
        """Build the model's `ModelVocab` now, on the compile thread, instead of at the first
        compile: a real tokenizer's takes seconds, which the first constrained request would
        wait for. A failure here (no tokenizer, no xgrammar) is met again, and reported, by the
        first compile."""
        return self._executor.submit(self._compiler)

    # ---------------------------------------------------------------- compile thread
    def _compiler(self) -> Any:
        compiler = getattr(self._lane_compiler, "compiler", None)
        if compiler is None:
            import xgrammar as xgr

            with self._vocab_lock:
                if self.vocab is None:
                    self.vocab = load_vocab(self.model_path, self.vocab_size, self.stop_ids)
            compiler = self._lane_compiler.compiler = xgr.GrammarCompiler(
                self.vocab.info, max_threads=1, cache_enabled=False)
        return compiler

    def _compile(self, key: tuple[str, str]) -> CompiledGrammar:
        import xgrammar as xgr

        kind, source = key
        compiler = self._compiler()
        start = time.perf_counter()
        try:
            if kind == "json_schema":
                ebnf = json_schema_ebnf(source)
            elif kind == "regex":
                ebnf = exclude_surrogates(str(xgr.Grammar.from_regex(source)))
            else:
                ebnf = exclude_surrogates(str(xgr.Grammar.from_ebnf(source)))
            compiled = compiler.compile_grammar(ebnf)
        except RecursionError:   # lowering a JSON schema recurses once (or more) per level
            raise GrammarError(f"{kind} nests too deeply to compile: flatten the "
                               f"{KIND_NAMES[kind]} (a JSON schema of about 250 levels is "
                               "past it)") from None
        except Exception as exc:   # xgrammar raises RuntimeError / ValueError subclasses
            raise GrammarError(f"{kind} is not a valid {KIND_NAMES[kind]}: "
                               f"{_clean(exc)}") from None
        if _matches_nothing(compiled, self.vocab):
            raise GrammarError(f"{kind} matches no output: no text satisfies this "
                               f"{KIND_NAMES[kind]}")
        self._observe(time.perf_counter() - start)
        return CompiledGrammar(compiled, not forces_long_text(kind, source))

    def _observe(self, seconds: float) -> None:
        self.compile_counts[bisect.bisect_left(GRAMMAR_COMPILE_BUCKETS, seconds)] += 1
        self.compile_seconds_sum += seconds
