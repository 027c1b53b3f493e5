"""Structured output on the tiny random model, which would otherwise emit noise: every constrained
output parses and validates (finite languages must end with "stop"), an infinite one ends at the
length limit, special tokens never slip in as text, jump-forward gives the same tokens as
token-by-token decoding in fewer forward passes, free requests in the same batch are untouched,
the overlapped loop gives the same outputs, and a bad constraint is refused before decoding."""

from __future__ import annotations

import ast
import json
import re
import time

import jsonschema
import pytest

from radixpool.tokenization import PromptTokenizer
from radixpool.worker.config import EngineConfig
from radixpool.worker.engine_core import EngineCore
from radixpool.worker.grammar.compiler import ModelVocab
from radixpool.worker.messages import GenerateRequest
from radixpool.worker.sampling_params import SamplingParams

FINITE_SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["color", "n", "name"],
     "properties": {"color": {"enum": ["red", "green", "blue"]},
                    "n": {"type": "integer", "minimum": 1, "maximum": 20},
                    "name": {"type": "string", "pattern": "^[a-z]{1,6}$"}}},
    {"type": "object", "additionalProperties": False, "required": ["ok", "tags"],
     "properties": {"ok": {"type": "boolean"},
                    "tags": {"type": "array", "minItems": 1, "maxItems": 3,
                             "items": {"enum": ["cache", "radix", "tree"]}}}},
    {"type": "array", "minItems": 2, "maxItems": 2,
     "items": {"type": "object", "additionalProperties": False, "required": ["id"],
               "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}}}},
]
REGEXES = [r"[0-9]{3}-[a-c]{2}", r"(yes|no|maybe)!", r"[A-Z][a-z]{2,5} [0-9]{1,2}(\.[0-9])?"]
# A finite arithmetic language: outputs are Python expressions.
EBNF = r'''
root ::= term (" " op " " term)?
term ::= num | "(" num " " op " " num ")"
op ::= "+" | "-" | "*"
num ::= [1-9] [0-9]?
'''
# Compact JSON as a regex: every forced character is one the tiny tokenizer never merges with
# its neighbours, and every free choice is one digit, so the output's tokens are unique.
COMPACT_JSON = r'\{"a":[0-9],"b":\[[0-9],[0-9],[0-9]\],"c":"[0-9]"\}'
COMPACT_SCHEMA = {"type": "object", "required": ["a", "b", "c"],
                  "properties": {"a": {"type": "integer"}, "b": {"type": "array"},
                                 "c": {"type": "string"}}}


@pytest.fixture(scope="module")
def tok(tiny_model):
    return PromptTokenizer.from_dir(tiny_model)


def run(model, requests, **options):
    """Drive an engine core to completion: {rid: (token ids, finish reason, error)}, steps."""
    options = {"device": "cpu", "kv_cache_tokens": 4096, "debug_invariants": True, **options}
    core = EngineCore(EngineConfig(str(model), **options))
    out: dict[str, list] = {}
    for rid, ids, params, seed in requests:
        delta = core.add_request(GenerateRequest(rid, ids, params, seed))
        assert delta is None, delta
        out[rid] = [[], None, None]
    while core.has_work:
        for delta in core.step().deltas:
            entry = out[delta.rid]
            entry[0] += delta.token_ids
            if delta.finished:
                entry[1], entry[2] = delta.finish_reason, delta.error
    core.check_invariants()
    return {rid: tuple(v) for rid, v in out.items()}, core


def text_of(tok, ids, eos=(2, 4)):
    if ids and ids[-1] in eos:
        ids = ids[:-1]
    return tok.tokenizer.decode(ids, skip_special_tokens=False)


def prompts(tok):
    return [tok.encode(p) for p in ("the quick brown fox", "answer in JSON please", "radix")]


@pytest.mark.parametrize("jump_forward", ["exact", "retokenize", "off"])
def test_finite_constrained_outputs_always_validate(tiny_model, tok, jump_forward):
    reqs = []
    for s, schema in enumerate(FINITE_SCHEMAS):
        for seed in range(4):
            params = SamplingParams(max_new_tokens=80, temperature=0 if seed == 0 else 1.3,
                                    json_schema=json.dumps(schema))
            reqs.append((f"json{s}-{seed}", prompts(tok)[seed % 3], params, seed))
    for r, pattern in enumerate(REGEXES):
        for seed in range(3):
            reqs.append((f"re{r}-{seed}", prompts(tok)[seed], SamplingParams(
                max_new_tokens=40, temperature=1.0, regex=pattern), seed))
    for seed in range(4):
        reqs.append((f"ebnf-{seed}", prompts(tok)[seed % 3], SamplingParams(
            max_new_tokens=40, temperature=1.2, ebnf=EBNF), seed))
    out, _ = run(tiny_model, reqs, jump_forward=jump_forward)
    for rid, (ids, reason, error) in out.items():
        assert error is None and reason == "stop", (rid, reason, error)
        assert ids[-1] in (2, 4), f"{rid} must end with a stop token once the grammar accepts"
        text = text_of(tok, ids)
        if rid.startswith("json"):
            jsonschema.validate(json.loads(text), FINITE_SCHEMAS[int(rid[4])])
        elif rid.startswith("re"):
            assert re.fullmatch(REGEXES[int(rid[2])], text), (rid, text)
        else:
            tree = ast.parse(text, mode="eval")   # an arithmetic expression Python can parse
            assert all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.operator))
                       for n in ast.walk(tree)), text


def test_infinite_language_ends_at_the_length_limit(tiny_model, tok):
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 40}
    reqs = [(f"r{seed}", prompts(tok)[0], SamplingParams(max_new_tokens=24, temperature=1.0,
                                                          json_schema=json.dumps(schema)), seed)
            for seed in range(3)]
    reqs.append(("obj", prompts(tok)[1], SamplingParams(
        max_new_tokens=12, temperature=1.0, json_schema='{"type": "object"}'), 5))
    out, _ = run(tiny_model, reqs)
    for rid, (ids, reason, _) in out.items():
        text = text_of(tok, ids)
        if rid == "obj" and reason == "stop":   # any object may be closed early
            assert isinstance(json.loads(text), dict)
            continue
        limit = 12 if rid == "obj" else 24
        assert reason == "length" and len(ids) == limit, (rid, reason, len(ids))
        assert text.startswith("{" if rid == "obj" else "[")
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)   # cut off by the limit, not finished


def test_special_tokens_never_appear_as_text(tiny_model, tok):
    """xgrammar sees `<s>` or `<|im_start|>` as text a string may contain; the engine masks
    them. A bias makes the model want them badly: without the mask they would be chosen."""
    special = [tok.tokenizer.token_to_id(t) for t in ("<s>", "<|im_start|>", "<pad>")]
    bias = {t: 100.0 for t in special}
    reqs = [(f"r{seed}", prompts(tok)[seed % 3], SamplingParams(
        max_new_tokens=30, temperature=1.0, logit_bias=bias, regex=r"[<>|a-z_/]{1,20}"), seed)
        for seed in range(4)]
    reqs.append(("free", prompts(tok)[0], SamplingParams(max_new_tokens=3, logit_bias=bias), 0))
    out, _ = run(tiny_model, reqs)
    assert set(out["free"][0]) & set(special), "the bias must make an unmasked row pick them"
    for rid, (ids, _, _) in out.items():
        if rid != "free":
            assert not set(ids) & set(special), (rid, ids)
            assert re.fullmatch(r"[<>|a-z_/]{1,20}", text_of(tok, ids)), rid


@pytest.mark.parametrize("mode", ["exact", "retokenize"])
def test_jump_forward_same_tokens_fewer_forward_passes(tiny_model, tok, mode):
    reqs = [(f"r{i}", prompts(tok)[i % 3], SamplingParams(
        max_new_tokens=60, temperature=0 if i < 2 else 1.0, regex=COMPACT_JSON), i)
        for i in range(6)]
    on, core_on = run(tiny_model, reqs, jump_forward=mode)
    off, core_off = run(tiny_model, reqs, jump_forward="off")
    assert on == off
    for ids, reason, _ in on.values():
        assert reason == "stop"
        jsonschema.validate(json.loads(text_of(tok, ids)), COMPACT_SCHEMA)
    assert core_on.scheduler.jump_forward_tokens > 0
    assert core_on.times.steps < core_off.times.steps * 0.75, \
        (core_on.times.steps, core_off.times.steps)


@pytest.mark.parametrize("mode", ["exact", "retokenize"])
def test_forced_text_that_starts_inside_a_character_is_finished_token_by_token(tiny_model, tok,
                                                                                mode):
    """Once the model has written the first byte token of a forced emoji, the rest is not text
    xgrammar can hand over (it is no UTF-8 alone): nothing is forced then, the engine goes on,
    and the output is what token-by-token decoding gives."""
    target = "東京🎉 café 👩\u200d👧 ok"
    reqs = [(f"r{i}", tok.encode(p), SamplingParams(
        max_new_tokens=60, temperature=0 if i < 2 else 1.0, regex=re.escape(target)), i)
        for i, p in enumerate(("Say:", "the quick brown fox", "radix"))]
    on, _ = run(tiny_model, reqs, jump_forward=mode)
    off, _ = run(tiny_model, reqs, jump_forward="off")
    for ids, reason, error in on.values():
        assert (text_of(tok, ids), reason, error) == (target, "stop", None)
    if mode == "exact":
        assert on == off


class FailingMatcher:
    """A request's matcher that raises the way a bug in the grammar library would: on the
    token `!` (`where="accept"`), or whenever its mask is filled (`where="mask"`)."""

    def __init__(self, matcher, vocab, where: str) -> None:
        self._matcher, self._vocab, self._where = matcher, vocab, where

    def accept_token(self, token: int) -> bool:
        if self._where == "accept" and b"!" in self._vocab.decoded[token]:
            raise RuntimeError("simulated grammar library failure")
        return self._matcher.accept_token(token)

    def fill_next_token_bitmask(self, *args):
        if self._where == "mask":
            raise RuntimeError("simulated grammar library failure")
        return self._matcher.fill_next_token_bitmask(*args)

    def __getattr__(self, name: str):
        if name == "_handle" and self._where == "mask":   # what the batched fill reads
            raise RuntimeError("simulated grammar library failure")
        return getattr(self._matcher, name)


@pytest.mark.parametrize("where", ["accept", "mask"])
@pytest.mark.parametrize(("mode", "overlap"), [("exact", False), ("retokenize", False),
                                               ("off", False), ("exact", True)])
def test_a_grammar_library_failure_ends_that_request_alone(tiny_model, tok, monkeypatch, where,
                                                            mode, overlap):
    """Before, the exception took the engine core down, and every request with it; a gateway or
    client retry then took the same request to the next worker, and that one down too."""
    from radixpool.worker.grammar.queue import GrammarQueue

    ready = GrammarQueue.ready

    def ready_with_a_failing_matcher(self):
        settled = ready(self)
        for req, _ in settled:
            if req.rid == "doomed" and req.grammar is not None:
                req.grammar.matcher = FailingMatcher(req.grammar.matcher, req.grammar.vocab,
                                                     where)
        return settled

    others = [(f"c{i}", prompts(tok)[i % 3], SamplingParams(
        max_new_tokens=60, temperature=1.0, json_schema=json.dumps(FINITE_SCHEMAS[i % 3])), i)
        for i in range(3)]
    others += [(f"f{i}", prompts(tok)[i % 3], SamplingParams(
        max_new_tokens=12, temperature=0.8, ignore_eos=True), 100 + i) for i in range(2)]
    doomed = ("doomed", prompts(tok)[0], SamplingParams(max_new_tokens=20, regex="(yes|no)!"), 0)
    options = {"jump_forward": mode, "overlap_schedule": overlap}
    alone, _ = run(tiny_model, others, **options)
    monkeypatch.setattr(GrammarQueue, "ready", ready_with_a_failing_matcher)
    out, _ = run(tiny_model, [doomed, *others], **options)   # invariants checked too
    _, reason, error = out.pop("doomed")
    assert reason == "abort" and error.startswith("regex could not be followed"), error
    assert "simulated grammar library failure" in error
    assert out == alone


@pytest.mark.parametrize("mode", ["exact", "retokenize"])
def test_forced_text_split_by_chunked_prefill_gives_the_same_tokens_and_cache(tiny_model, mode):
    # Retokenized forced text of 9 tokens, in 8-token chunks: the one left over went as a decode,
    # which read the sampled token the forced ones had replaced, and the KV computed from it
    # went into the radix cache under the forced token's id, for later requests to reuse.
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer"}}}
    prompt = [11, 12, 13]
    constrained = SamplingParams(max_new_tokens=30, temperature=0, json_schema=json.dumps(schema))
    outputs = {chunk: run(tiny_model, [("json", prompt, constrained, 0)], jump_forward=mode,
                          chunked_prefill_size=chunk, max_prefill_tokens=chunk)[0]["json"][0]
               for chunk in (2048, 8, 4, 3)}
    assert len({tuple(ids) for ids in outputs.values()}) == 1, outputs
    # a request continuing from that output reuses its KV: the same greedy tokens as cold
    follow = [*prompt, *outputs[8][:20]]
    plain = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    core = EngineCore(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=4096,
                                   debug_invariants=True, jump_forward=mode,
                                   chunked_prefill_size=8, max_prefill_tokens=8))
    answers: dict[str, list[int]] = {"json": [], "warm": []}
    for rid, ids, params in (("json", prompt, constrained), ("warm", follow, plain)):
        assert core.add_request(GenerateRequest(rid, ids, params, 0)) is None
        cached = 0
        while core.has_work:
            for delta in core.step().deltas:
                answers[delta.rid] += delta.token_ids
                cached = max(cached, delta.cached_tokens)
    assert cached >= 16   # the follow-up did reuse the constrained request's KV
    cold, _ = run(tiny_model, [("cold", follow, plain, 0)])
    assert answers["warm"] == cold["cold"][0]


def test_jump_forward_appends_forced_text_in_one_step(tiny_model, tok):
    """On a schema whose keys are forced text, jump-forward produces valid output with far
    fewer forward passes than tokens."""
    schema = FINITE_SCHEMAS[0]
    reqs = [("r", prompts(tok)[0], SamplingParams(max_new_tokens=80, temperature=0,
                                                   json_schema=json.dumps(schema)), 0)]
    out, core = run(tiny_model, reqs)   # (the default mode: exact)
    ids, reason, _ = out["r"]
    assert reason == "stop"
    jsonschema.validate(json.loads(text_of(tok, ids)), schema)
    assert core.times.steps < len(ids) / 1.5, (core.times.steps, len(ids))


@pytest.mark.parametrize("mode", ["exact", "retokenize"])
def test_a_long_forced_run_is_tokenized_only_as_far_as_the_request_goes(tiny_model, tok,
                                                                         monkeypatch, mode):
    """`a{4000}` forces 4,000 characters (`a{1000000}` a million; those, `forced_length` now
    keeps from jump-forward): the engine held every request's step while it tokenized them all
    for an 8-token answer (seconds for ten million)."""
    encoded: list[int] = []
    encode = ModelVocab.encode
    monkeypatch.setattr(ModelVocab, "encode",
                        lambda vocab, text: encoded.append(len(text)) or encode(vocab, text))
    reqs = [("r", prompts(tok)[0], SamplingParams(max_new_tokens=8, regex="a{4000}"), 0)]
    out, _ = run(tiny_model, reqs, jump_forward=mode)
    ids, reason, _ = out["r"]
    assert (len(ids), reason, set(text_of(tok, ids))) == (8, "length", {"a"})
    assert encoded and max(encoded) < 1000, encoded   # 8 tokens spell a few dozen characters


def test_a_constraint_that_may_force_a_long_run_is_decoded_token_by_token(tiny_model, tok,
                                                                          monkeypatch):
    """xgrammar computes a forced run whole, every time it is asked: 30,000 items of one
    `const` took 164 s and 22.9 GB. Such constraints skip jump-forward (here 100 items, cheap
    enough to ask for on the old code); an ordinary one beside them still uses it."""
    import xgrammar as xgr

    from radixpool.worker.grammar.forced_length import forces_long_text

    asked: list[str] = []
    find = xgr.GrammarMatcher.find_jump_forward_string
    monkeypatch.setattr(xgr.GrammarMatcher, "find_jump_forward_string",
                        lambda matcher: asked.append(find(matcher)) or asked[-1])
    long = json.dumps({"type": "array", "items": {"const": "x"}, "minItems": 100})
    assert forces_long_text("json_schema", long)
    assert forces_long_text("regex", "(a{100}){100}")
    assert forces_long_text("ebnf", 'root ::= "a"{5000}')
    assert not forces_long_text("json_schema", json.dumps(FINITE_SCHEMAS[1]))
    out, _ = run(tiny_model, [("long", prompts(tok)[0], SamplingParams(max_new_tokens=12,
                                                                        json_schema=long), 0)])
    ids, reason, _ = out["long"]
    assert (len(ids), reason) == (12, "length") and text_of(tok, ids).startswith('["x", "x"')
    assert asked == []
    out, _ = run(tiny_model, [("plain", prompts(tok)[0], SamplingParams(
        max_new_tokens=40, json_schema=json.dumps(FINITE_SCHEMAS[1])), 0)])
    assert asked and out["plain"][1] == "stop"


def test_free_requests_in_a_mixed_batch_are_untouched(tiny_model, tok):
    free = [(f"free{i}", prompts(tok)[i % 3], SamplingParams(
        max_new_tokens=12, temperature=0.8, ignore_eos=True), 100 + i) for i in range(4)]
    constrained = [(f"c{i}", prompts(tok)[i % 3], SamplingParams(
        max_new_tokens=60, temperature=1.0, json_schema=json.dumps(FINITE_SCHEMAS[i % 3])), i)
        for i in range(4)]
    alone, _ = run(tiny_model, free)
    mixed, _ = run(tiny_model, free + constrained)
    for rid in alone:
        assert mixed[rid] == alone[rid], rid
    assert all(mixed[f"c{i}"][1] == "stop" for i in range(4))


@pytest.mark.parametrize("jump_forward", ["exact", "retokenize", "off"])
def test_overlapped_loop_gives_the_same_constrained_outputs(tiny_model, tok, jump_forward):
    reqs = [(f"c{i}", prompts(tok)[i % 3], SamplingParams(
        max_new_tokens=50, temperature=1.0, json_schema=json.dumps(FINITE_SCHEMAS[i % 3])), i)
        for i in range(4)]
    reqs += [(f"f{i}", prompts(tok)[i % 3], SamplingParams(max_new_tokens=10, temperature=0.7),
              50 + i) for i in range(3)]
    sync, _ = run(tiny_model, reqs, overlap_schedule=False, jump_forward=jump_forward)
    overlapped, _ = run(tiny_model, reqs, overlap_schedule=True, jump_forward=jump_forward)
    assert sync == overlapped


def test_bad_constraint_is_refused_before_decoding_and_others_run(tiny_model, tok):
    reqs = [("bad_schema", prompts(tok)[0], SamplingParams(json_schema='{"type": "nope"}'), 0),
            ("bad_regex", prompts(tok)[0], SamplingParams(regex="[a-"), 0),
            ("bad_ebnf", prompts(tok)[0], SamplingParams(ebnf='root ::= "x" | foo'), 0),
            ("good", prompts(tok)[0], SamplingParams(max_new_tokens=20, regex="(yes|no)"), 0)]
    out, _ = run(tiny_model, reqs)
    for rid, field in (("bad_schema", "json_schema"), ("bad_regex", "regex"),
                       ("bad_ebnf", "ebnf")):
        ids, reason, error = out[rid]
        assert ids == [] and reason == "abort" and error.startswith(field), error
    assert "nope" in out["bad_schema"][2] and "foo" in out["bad_ebnf"][2]
    assert out["good"][1] == "stop"


def test_compile_cache_and_its_metrics(tiny_model, tok):
    schema = json.dumps(FINITE_SCHEMAS[1])
    reqs = [(f"r{i}", prompts(tok)[0], SamplingParams(max_new_tokens=40, json_schema=schema),
             i) for i in range(5)]
    reqs.append(("other", prompts(tok)[0], SamplingParams(max_new_tokens=20, regex="(a|b)"), 9))
    _, core = run(tiny_model, reqs)
    stats = core.stats()
    assert stats.grammar_compile_buckets[-1] == 2   # two distinct grammars compiled once each
    assert stats.grammar_cache_hits_total == 4
    assert stats.grammar_compile_seconds_sum > 0


def test_a_schema_slow_to_compile_does_not_hold_up_the_ordinary_ones(tiny_model):
    """Compiles ran on one thread: a schema of many optional properties (their compile time
    grows faster than their square; 800 took 82 s) held every other request's schema behind it."""
    from radixpool.worker.grammar.compiler import GrammarCompiler, looks_heavy

    slow = json.dumps({"type": "object",
                       "properties": {f"p{i}": {"type": "integer"} for i in range(200)}})
    plain = json.dumps(FINITE_SCHEMAS[1])
    assert looks_heavy("json_schema", slow) and not looks_heavy("json_schema", plain)
    assert not looks_heavy("json_schema", json.dumps(   # every property required: not slow
        {"type": "object", "properties": {f"p{i}": {} for i in range(300)},
         "required": [f"p{i}" for i in range(300)]}))
    # Nested 200 levels: 12 KB of text, 3 s in xgrammar's schema converter on this tiny model
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    nested = json.dumps(deep)
    compiler = GrammarCompiler(str(tiny_model), 1024, (2, 4))
    compiler.prepare().result()
    for indent, slow_one in enumerate((slow, nested)):
        assert looks_heavy("json_schema", slow_one)
        heavy = compiler.submit(("json_schema", slow_one))
        time.sleep(0.05)   # under way
        started = time.perf_counter()
        # (the same ordinary schema as text of its own, not answered from the compile cache)
        ordinary = json.dumps(FINITE_SCHEMAS[1], indent=indent or None)
        compiler.submit(("json_schema", ordinary)).result()
        waited = time.perf_counter() - started
        assert not heavy.done(), f"the ordinary schema waited {waited:.2f} s for the slow one"
        heavy.result()


def test_a_constraint_past_the_compile_timeout_is_refused_and_others_run(tiny_model, tok):
    """A constrained request waited for its compile however long it took (800 optional
    properties took 82 s, and nothing bounds a hostile schema): its client's own timeout, or
    the gateway's 300 s, ended it with no word of why. Now `grammar_compile_timeout_s` refuses
    it naming the constraint; a compile under way goes on and is cached, one not yet started is
    called off."""
    def slow(n: int) -> str:   # ~2 s to compile on this tiny model (heavy lane)
        return json.dumps({"type": "object",
                           "properties": {f"p{i}": {"type": "integer"} for i in range(n)}})

    core = EngineCore(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=4096,
                                   grammar_compile_timeout_s=0.5))
    plain = SamplingParams(max_new_tokens=40, json_schema=json.dumps(FINITE_SCHEMAS[1]))
    ended: dict[str, tuple[str, str | None]] = {}

    def send(rid: str, params: SamplingParams) -> None:
        assert core.add_request(GenerateRequest(rid, prompts(tok)[0], params, 0)) is None

    def run_out() -> None:
        while core.has_work:
            for delta in core.step().deltas:
                if delta.finished:
                    ended[delta.rid] = (delta.finish_reason, delta.error)

    send("plain", plain)
    run_out()   # its grammar compiled and cached: the timeout below is not what it measures
    send("slow_a", SamplingParams(max_new_tokens=8, json_schema=slow(200)))
    send("slow_b", SamplingParams(max_new_tokens=8, json_schema=slow(201)))  # queued behind a
    send("plain_again", plain)
    send("free", SamplingParams(max_new_tokens=8))
    run_out()
    assert ended["plain"][1] is None and ended["plain_again"][1] is None
    assert ended["free"] == ("length", None)
    for rid in ("slow_a", "slow_b"):
        reason, error = ended[rid]
        assert reason == "abort" and error.startswith(
            "json_schema did not compile within 0.5 s (--grammar-compile-timeout)"), error
    assert "compiles on" in ended["slow_a"][1] and "compiles on" not in ended["slow_b"][1]
    deadline = time.monotonic() + 120
    while core.stats().grammar_compile_buckets[-1] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)   # slow_a's compile, under way when it timed out, goes on
    assert core.stats().grammar_compile_buckets[-1] == 2
    hits = core.stats().grammar_cache_hits_total
    send("slow_a_again", SamplingParams(max_new_tokens=8, json_schema=slow(200)))
    send("slow_b_again", SamplingParams(max_new_tokens=8, json_schema=slow(201)))
    run_out()
    assert ended["slow_a_again"][1] is None   # served from the cache at once
    # slow_b's compile was called off before it started: sent again, it compiles anew
    assert core.stats().grammar_cache_hits_total == hits + 1
    assert ended["slow_b_again"][0] == "abort"


def test_two_constraints_at_once_are_refused():
    with pytest.raises(ValueError, match="json_schema and regex were both given"):
        SamplingParams(json_schema='{"type": "object"}', regex="a")
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        SamplingParams(json_schema="{not json")
    with pytest.raises(ValueError, match="json_schema must be a JSON object"):
        SamplingParams(json_schema="[1, 2]")
    with pytest.raises(ValueError, match="regex has 100001 characters"):
        SamplingParams(regex="a" * 100_001)
    params = SamplingParams.from_dict({"json_schema": {"type": "object"}})
    assert params.constraint == ("json_schema", '{"type": "object"}')


@pytest.mark.parametrize("mode", ["exact", "retokenize"])
def test_jump_forward_equals_greedy_constrained_decoding_by_transformers(tiny_model, tok, mode):
    """The reference: Hugging Face `transformers` recomputing the whole sequence for every token,
    the grammar's mask applied, argmax. "retokenize": where the grammar forces text, the
    reference appends the same re-split tokens (one reference pass per sampled token), and the
    engine takes as many forward passes as the reference. "exact": the reference decodes every
    token (no jump), and the engine gives the same tokens in fewer passes than tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from radixpool.worker.grammar.compiler import GrammarCompiler
    from radixpool.worker.grammar.mask import GrammarMasks
    from radixpool.worker.grammar.matcher import RequestGrammar

    schema = FINITE_SCHEMAS[0]
    prompt = prompts(tok)[1]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    compiler = GrammarCompiler(str(tiny_model), 1024, (2, 4))
    compiled = compiler.submit(("json_schema", json.dumps(schema))).result()
    grammar = RequestGrammar(compiled, compiler.vocab)
    masks = GrammarMasks(compiler.vocab, 1024, torch.device("cpu"))
    out: list[int] = []
    passes = 0
    with torch.no_grad():
        while not grammar.terminated and len(out) < 80:
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            token = int(logits.masked_fill(~masks.build([grammar])[0], -torch.inf).argmax())
            passes += 1
            assert grammar.accept(token)
            out.append(token)
            if not grammar.terminated and mode == "retokenize":
                forced = grammar.jump_forward(token, 80 - len(out) + 1)
                if forced is not None:
                    out[-1:] = forced

    result, core = run(tiny_model, [("r", prompt, SamplingParams(
        max_new_tokens=80, temperature=0, json_schema=json.dumps(schema)), 0)],
        jump_forward=mode)
    ids, reason, _ = result["r"]
    assert ids == out and reason == "stop"
    jsonschema.validate(json.loads(text_of(tok, ids)), schema)
    if mode == "retokenize":
        assert core.times.steps == passes < len(ids) / 1.5, (core.times.steps, passes, len(ids))
    else:
        assert passes == len(ids) and core.times.steps < len(ids) / 1.5, \
            (core.times.steps, len(ids))


BOUNDED_STRINGS = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                   "properties": {"a": {"type": "string", "maxLength": 6},
                                  "b": {"type": "string", "minLength": 2, "maxLength": 4}}}


@pytest.mark.parametrize("text,valid", [
    ('{"a": "ab\\u0009c", "b": "xy"}', True),     # escapes count as one character
    ('{"a": "a\\"b\\\\", "b": "\\n\\t"}', True),
    ('{"a": "ab\tc", "b": "xy"}', False),         # a raw control character is not JSON
    ('{"a": "abc\x11", "b": "xy"}', False),
    ('{"a": "abcdefg", "b": "xy"}', False),       # the bounds hold
    ('{"a": "", "b": "x"}', False),
])
def test_length_bounded_strings_are_json_strings(text, valid):
    import xgrammar as xgr

    from radixpool.worker.grammar.json_schema import json_schema_ebnf

    grammar = xgr.Grammar.from_ebnf(json_schema_ebnf(json.dumps(BOUNDED_STRINGS)))
    assert xgr.testing._is_grammar_accept_string(grammar, text) is valid
    if valid:
        jsonschema.validate(json.loads(text), BOUNDED_STRINGS)


def sampled_texts(model, tok, **constraint) -> list[str]:
    """24 hot samples (T=1.5, seeded) under one constraint; each must end by "stop"."""
    reqs = [(f"s{seed}", prompts(tok)[seed % 3], SamplingParams(
        max_new_tokens=40, temperature=1.5, **constraint), seed) for seed in range(24)]
    out, _ = run(model, reqs)
    for rid, (_, reason, error) in out.items():
        assert error is None and reason == "stop", (rid, reason, error)
    return [text_of(tok, ids) for ids, _, _ in out.values()]


def test_sampled_length_bounded_strings_always_parse(tiny_model, tok):
    # xgrammar alone lets raw control characters into such strings (mlc-ai/xgrammar#800).
    for text in sampled_texts(tiny_model, tok, json_schema=json.dumps(BOUNDED_STRINGS)):
        jsonschema.validate(json.loads(text), BOUNDED_STRINGS)


def test_no_character_class_admits_a_surrogate():
    import xgrammar as xgr

    from radixpool.worker.grammar.surrogates import exclude_surrogates

    ebnf = exclude_surrogates(str(xgr.Grammar.from_regex(r"a.[^x]\[\^")))
    assert ebnf == exclude_surrogates(ebnf)   # idempotent: the tool grammars pass twice
    assert r"[\0-\ud7ff\ue000-\U0010ffff]" in ebnf and r"[^\ud800-\udfffx]" in ebnf
    user = 'root ::= "[^\\"" [^a]+'
    assert exclude_surrogates(user) == 'root ::= "[^\\"" [^\\ud800-\\udfffa]+'   # literal kept


def test_sampled_any_character_regex_always_matches(tiny_model, tok):
    # "." lets xgrammar take a surrogate's three UTF-8 bytes from byte tokens as one character.
    pattern = r"<.{4}>( .[^ ]{2}){2}"
    for text in sampled_texts(tiny_model, tok, regex=pattern):
        assert re.fullmatch(pattern, text, re.DOTALL), text


def test_a_schema_pattern_matches_no_surrogate():
    from radixpool.worker.grammar.surrogates import exclude_surrogates_from_regex as mend

    s = r"\ud800-\udfff"
    assert mend(r"^a.\.[^x][a.]$") == rf"^a[^{s}]\.[^{s}x][a.]$"
    assert mend(r"[\]^.]+") == r"[\]^.]+"


def test_sampled_schema_patterns_always_match(tiny_model, tok):
    schema = {"type": "object", "required": ["a"], "additionalProperties": False,
              "properties": {"a": {"type": "string", "pattern": "^.{4}$"},
                             "b": {"enum": [{"pattern": "a.b"}]}}}
    for text in sampled_texts(tiny_model, tok, json_schema=json.dumps(schema)):
        jsonschema.validate(json.loads(text), schema)   # the enum's data is kept
