"""Exact jump-forward on the tiny random model: the forced text is a draft that one extend step
verifies, so the output is token for token what jump-forward off (one forward pass per token)
gives — greedy and seeded sampling, penalties, length limits, stop tokens, logprobs (no draft),
overlap on or off, pages of 1 and 16 — in fewer forward passes; rejected draft tokens leave no
KV behind and never reach the radix cache. Plus the verify rule itself on hand-built logits."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from test_structured_output import run, text_of

from radixpool.tokenization import PromptTokenizer
from radixpool.worker import Engine
from radixpool.worker.grammar.draft import commit
from radixpool.worker.sampler import Sampler, SamplingRow
from radixpool.worker.sampling_params import SamplingParams

SCHEMAS = [
    # nested objects, enums, bounded integers, strings
    {"type": "object", "additionalProperties": False, "required": ["user", "role"],
     "properties": {
         "user": {"type": "object", "additionalProperties": False,
                  "required": ["name", "age", "address"],
                  "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                 "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                 "address": {"type": "object", "additionalProperties": False,
                                             "required": ["city", "zip"],
                                             "properties": {
                                                 "city": {"enum": ["Paris", "Lyon", "Nice"]},
                                                 "zip": {"type": "string",
                                                         "pattern": "^[0-9]{5}$"}}}}},
         "role": {"enum": ["administrator", "maintainer", "contributor"]}}},
    # arrays of objects, booleans
    {"type": "object", "additionalProperties": False, "required": ["items", "done"],
     "properties": {
         "items": {"type": "array", "minItems": 1, "maxItems": 3,
                   "items": {"type": "object", "additionalProperties": False,
                             "required": ["sku", "qty"],
                             "properties": {"sku": {"enum": ["apple-juice", "banana-bread"]},
                                            "qty": {"type": "integer", "minimum": 1,
                                                    "maximum": 9}}}},
         "done": {"type": "boolean"}}},
    # an array of enum strings
    {"type": "array", "minItems": 2, "maxItems": 4,
     "items": {"enum": ["radix-cache", "paged-pool", "scheduler"]}},
]
REGEX = r"(temperature|pressure|humidity) = [0-9]{1,3}\.[0-9] (celsius|pascal|percent)"


@pytest.fixture(scope="module")
def tok(tiny_model):
    return PromptTokenizer.from_dir(tiny_model)


def workload(tok, temperature: float, **extra) -> list:
    prompts = [tok.encode(p) for p in ("the quick brown fox", "answer in JSON please", "radix")]
    reqs = []
    for s, schema in enumerate(SCHEMAS):
        for i in range(2):
            reqs.append((f"json{s}-{i}", prompts[(s + i) % 3], SamplingParams(
                max_new_tokens=120, temperature=temperature, json_schema=json.dumps(schema),
                **extra), 10 * s + i))
    reqs.append(("regex", prompts[0], SamplingParams(max_new_tokens=60, temperature=temperature,
                                                     regex=REGEX, **extra), 7))
    reqs += [(f"free{i}", prompts[i], SamplingParams(max_new_tokens=20, temperature=0.8), 50 + i)
             for i in range(3)]
    return reqs


def cached_paths(core) -> list[list[int]]:
    """Every root-to-leaf token path of the radix cache."""
    paths = []
    for node in core.cache.nodes():
        if node.children:
            continue
        key: list[int] = []
        while node.parent is not None:
            key[:0] = list(node.key)
            node = node.parent
        paths.append(key)
    return paths


def check_cache_holds_committed_tokens(core, reqs, out) -> None:
    """The tree holds each finished sequence's KV (all but its last token, whole pages) and
    nothing else: no rejected draft token ever reached it."""
    ps = core.config.page_size
    sequences = [ids + out[rid][0] for rid, ids, _, _ in reqs]
    for seq in sequences:
        assert core.probe(seq) == (len(seq) - 1) // ps * ps
    for path in cached_paths(core):
        assert any(seq[:len(path)] == path for seq in sequences), path
    assert core.runner.kv_pool.free_pages + core.cache.total_size // ps == \
        core.runner.kv_pool.num_pages   # every page not in the tree is free again


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_exact_equals_token_by_token_in_fewer_passes(tiny_model, tok, page_size):
    reqs = workload(tok, temperature=0)
    exact, core = run(tiny_model, reqs, jump_forward="exact", page_size=page_size)
    off, core_off = run(tiny_model, reqs, jump_forward="off", page_size=page_size)
    assert exact == off
    for s, schema in enumerate(SCHEMAS):
        for i in range(2):
            ids, reason, _ = exact[f"json{s}-{i}"]
            assert reason == "stop"
            jsonschema.validate(json.loads(text_of(tok, ids)), schema)
    assert re.fullmatch(REGEX, text_of(tok, exact["regex"][0]))
    assert core.scheduler.jump_forward_tokens > 0
    assert core.times.steps < core_off.times.steps * 0.8, \
        (core.times.steps, core_off.times.steps)
    check_cache_holds_committed_tokens(core, reqs, exact)


def test_sampled_exact_equals_token_by_token_with_the_same_seeds(tiny_model, tok):
    """The sampler's draw at a step depends only on (logits, params, seed, step): verifying the
    draft against it gives the very tokens token-by-token sampling gives, and replays."""
    reqs = workload(tok, temperature=1.1, top_k=40, top_p=0.95, min_p=0.01)
    exact, core = run(tiny_model, reqs, jump_forward="exact", page_size=16)
    again, _ = run(tiny_model, reqs, jump_forward="exact", page_size=16)
    off, core_off = run(tiny_model, reqs, jump_forward="off", page_size=16)
    assert exact == again == off
    assert core.scheduler.jump_forward_tokens > 0 and core.times.steps < core_off.times.steps
    check_cache_holds_committed_tokens(core, reqs, exact)


def test_penalties_limits_stop_tokens_and_logprobs_stay_exact(tiny_model, tok):
    base, _ = run(tiny_model, workload(tok, temperature=0)[:1], jump_forward="off")
    stop_id = base["json0-0"][0][6]   # a token inside the forced text of the first schema
    reqs = workload(tok, temperature=0.9, frequency_penalty=0.5, presence_penalty=0.3,
                    repetition_penalty=1.2)
    reqs += [(f"short{n}", reqs[0][1], SamplingParams(
        max_new_tokens=n, temperature=0, json_schema=json.dumps(SCHEMAS[0])), 0)
        for n in (3, 7, 12)]
    reqs += [("stop_id", reqs[0][1], SamplingParams(
        max_new_tokens=80, temperature=0, json_schema=json.dumps(SCHEMAS[0]),
        stop_token_ids=(stop_id,)), 0)]
    reqs += [("min_new", reqs[0][1], SamplingParams(
        max_new_tokens=80, min_new_tokens=30, temperature=0.7, regex=REGEX), 3)]
    reqs += [("logprobs", reqs[0][1], SamplingParams(
        max_new_tokens=80, temperature=0, json_schema=json.dumps(SCHEMAS[1]), logprobs=2), 0)]
    exact, core = run(tiny_model, reqs, jump_forward="exact", page_size=16)
    off, _ = run(tiny_model, reqs, jump_forward="off", page_size=16)
    assert exact == off
    for n in (3, 7, 12):
        assert exact[f"short{n}"][1] == "length" and len(exact[f"short{n}"][0]) == n
    assert exact["stop_id"][0][-1] == stop_id and exact["stop_id"][1] == "stop"
    check_cache_holds_committed_tokens(core, reqs, exact)


@pytest.mark.parametrize("page_size", [1, 16])
def test_overlapped_loop_gives_the_same_exact_outputs(tiny_model, tok, page_size):
    reqs = workload(tok, temperature=0.9)
    sync, _ = run(tiny_model, reqs, jump_forward="exact", page_size=page_size,
                  overlap_schedule=False)
    overlapped, core = run(tiny_model, reqs, jump_forward="exact", page_size=page_size,
                           overlap_schedule=True)
    assert sync == overlapped
    check_cache_holds_committed_tokens(core, reqs, overlapped)


def test_offline_engine_exact_equals_off_in_text_and_tokens(tiny_model, tok):
    prompts = ["the quick brown fox", "answer in JSON please", "radix", "free text here"]
    params = [{"max_new_tokens": 100, "temperature": 0, "json_schema": SCHEMAS[i % 3]}
              for i in range(3)] + [{"max_new_tokens": 12, "temperature": 0}]
    outputs = {}
    for mode in ("exact", "off"):
        with Engine(str(tiny_model), device="cpu", kv_cache_tokens=4096, page_size=16,
                    jump_forward=mode, debug_invariants=True) as eng:
            outputs[mode] = eng.generate(prompts, params)
    for a, b in zip(outputs["exact"], outputs["off"]):
        assert a["text"] == b["text"] and a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["completion_tokens"] == len(a["output_ids"])
    for i in range(3):
        jsonschema.validate(json.loads(outputs["exact"][i]["text"]), SCHEMAS[i])


# ---------------------------------------------------------------- the verify rule, by hand
def choose(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, seeds: list[int],
           mask: torch.Tensor | None = None) -> torch.Tensor:
    rows = [SamplingRow(params, seed, [1], [], None, 0) for seed in seeds]
    return sampler.sample(logits.expand(len(seeds), -1).clone(), rows, vocab_mask=mask).tensor


def test_commit_accepts_the_matching_prefix_then_emits_the_first_other_choice():
    assert commit([5, 6, 7], [5, 6, 7, 9]) == [5, 6, 7, 9]   # all accepted + the next token
    assert commit([5, 6, 7], [5, 8, 7, 9]) == [5, 8]          # d2 rejected: the choice instead
    assert commit([5, 6, 7], [4, 6, 7, 9]) == [4]             # at least one token, always
    assert commit([], [3]) == [3]


def test_greedy_verify_takes_the_masked_argmax():
    sampler = Sampler(8, eos_token_ids=(2,))
    logits = torch.tensor([[0.0, 0, 0, 5, 0, 0, 1, 0],    # position 0: 3 is the argmax
                           [0.0, 0, 0, 0, 0, 4, 9, 0]])   # position 1: 6, but the mask forbids it
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 6] = False
    rows = [SamplingRow(SamplingParams(temperature=0), 0, [1], [], None, s) for s in (0, 1)]
    chosen = sampler.sample(logits, rows, vocab_mask=mask).token_ids
    assert commit([3, 6], [*chosen, 0][:3]) == [3, 5]   # d1 accepted, d2 replaced by 5


def test_sampled_verify_is_speculative_sampling_with_a_one_point_draft():
    """Accept d with probability p(d); a rejection emits a draw from p with d removed."""
    sampler = Sampler(8, eos_token_ids=(2,))
    probs = torch.tensor([0, 0.5, 0.3, 0.2, 0, 0, 0, 0])
    logits = probs.clamp_min(1e-30).log().unsqueeze(0)
    seeds = list(range(6000))
    chosen = choose(sampler, logits, SamplingParams(temperature=1.0), seeds).tolist()
    emitted = [commit([1], [c, -1]) for c in chosen]
    accepted = sum(e == [1, -1] for e in emitted) / len(seeds)
    assert abs(accepted - 0.5) < 0.03, accepted
    rejected = [e[0] for e in emitted if len(e) == 1]
    assert 1 not in rejected and set(rejected) == {2, 3}
    assert abs(rejected.count(2) / len(rejected) - 0.6) < 0.04   # 0.3 / (0.3 + 0.2)
    # a draft token the grammar forbids is always rejected
    mask = torch.ones(len(seeds), 8, dtype=torch.bool)
    mask[:, 1] = False
    masked = choose(sampler, logits, SamplingParams(temperature=1.0), seeds, mask).tolist()
    assert 1 not in masked and set(masked) == {2, 3}


def test_the_jump_forward_flag(tmp_path):
    from radixpool.cli import build_parser
    from radixpool.worker.config import EngineConfig
    from radixpool.worker.server.config import config_from_args

    model = tmp_path / "m"
    model.mkdir()

    def mode(*flags: str) -> str:
        args = build_parser().parse_args(["worker", "--model", str(model), *flags])
        return config_from_args(args).engine.jump_forward

    assert mode() == "exact"
    assert mode("--jump-forward", "retokenize") == "retokenize"
    assert mode("--jump-forward", "off") == mode("--no-jump-forward") == "off"
    with pytest.raises(SystemExit):
        mode("--jump-forward", "sometimes")
    assert EngineConfig("m", jump_forward=False).jump_forward == "off"   # the old bool form
    with pytest.raises(ValueError, match=r"jump_forward must be exact \| retokenize \| off"):
        EngineConfig("m", jump_forward="fast")


@pytest.mark.parametrize("page_size", [1, 16])
def test_abort_while_a_draft_is_in_flight_drops_its_kv(tiny_model, tok, page_size):
    """Overlapped loop: a request aborted while the step verifying its draft is in flight gives
    back every page, and the tree gets only its committed tokens."""
    from radixpool.worker.config import EngineConfig
    from radixpool.worker.engine_core import EngineCore
    from radixpool.worker.messages import GenerateRequest

    core = EngineCore(EngineConfig(str(tiny_model), device="cpu", kv_cache_tokens=4096,
                                   page_size=page_size, overlap_schedule=True,
                                   debug_invariants=True))
    prompt = tok.encode("answer in JSON please")
    params = SamplingParams(max_new_tokens=120, temperature=0, json_schema=json.dumps(SCHEMAS[0]))
    core.add_request(GenerateRequest("r", prompt, params, 0))
    drafted = False
    for _ in range(200):
        core.step()
        inflight = core._inflight
        if inflight is not None and any(len(d) > 1 for d in inflight.batch.drafts):
            drafted = True
            break
    assert drafted, "the request never had a draft in flight"
    req = core.scheduler.running["r"]
    committed = prompt + list(req.output_ids)
    assert req.kv_len > req.seq_len   # the draft's KV is allocated
    assert core.abort("r") is not None
    while core.has_work:
        core.step()
    core.check_invariants()
    paths = cached_paths(core)
    assert all(committed[:len(p)] == p for p in paths), (paths, committed)
    # the in-flight step computed the last committed token: all of it is cached
    assert core.probe(committed) == len(committed) // page_size * page_size
    assert core.runner.kv_pool.free_pages + core.cache.total_size // page_size == \
        core.runner.kv_pool.num_pages
