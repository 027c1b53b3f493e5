"""Naming the field where a JSON body nests past the parsers' depth (`radixpool.json_depth`)."""

from __future__ import annotations

import json

import pydantic_core
import pytest

from radixpool.json_depth import MAX_DEPTH, too_deep


def nested(depth: int, opener: str = "[", closer: str = "]", inner: str = "") -> str:
    return opener * depth + inner + closer * depth


def test_the_field_is_named_through_keys_indexes_and_tricky_strings():
    deep = nested(MAX_DEPTH + 1)
    body = '{"model": "m", "notes": "a, [b {c", "k\\"ey": [1, "x]", {"q": 2}, ' + deep + "]}"
    found = too_deep(body)
    assert found is not None and found.param == 'k"ey[3][0][0][0][0][0][0]'
    # the body and the list hold the deep value's first 2 levels: its 199th "[" is level 201
    assert (found.line, found.column) == (1, body.index("[[") + 1 + MAX_DEPTH - 2)
    assert "nests more than 200 levels deep" in found.message()
    # objects in objects: the path's first 8 parts
    doc = {"a": json.loads(nested(MAX_DEPTH, '{"b":', "}", "1"))}
    assert too_deep(json.dumps(doc)).param == "a.b.b.b.b.b.b.b"
    # the line and column of a pretty-printed body
    pretty = '{\n  "x":\n    ' + nested(MAX_DEPTH + 1) + "\n}"
    assert (too_deep(pretty).line, too_deep(pretty).column) == (3, 5 + MAX_DEPTH - 1)
    # a top-level array: the body itself has no name, its elements do
    assert too_deep(nested(MAX_DEPTH + 1)).param == "[0][0][0][0][0][0][0][0]"


def test_bodies_at_the_limit_are_left_alone_and_the_limit_is_the_workers_parsers():
    at_limit = nested(MAX_DEPTH)
    assert too_deep(at_limit) is None and too_deep('{"a": [1, {"b": "[[[["}]}') is None
    # the workers' parser takes MAX_DEPTH levels and refuses MAX_DEPTH + 2: every body it
    # refuses for depth, the scan names (objects count one level more there than arrays)
    pydantic_core.from_json(at_limit)
    pydantic_core.from_json(nested(MAX_DEPTH, '{"a":', "}", "1"))
    for body in (nested(MAX_DEPTH + 2), nested(MAX_DEPTH + 1, '{"a":', "}", "1")):
        with pytest.raises(ValueError, match="recursion limit"):
            pydantic_core.from_json(body)
        assert too_deep(body) is not None


def test_the_scan_stops_after_its_budget():
    filler = ",".join(["1"] * 30_000)
    late = '{"p": [' + filler + '], "q": ' + nested(MAX_DEPTH + 1) + "}"
    assert too_deep(late) is None                 # past 20,000 tokens the parser's message stands
    assert too_deep(late, budget=100_000).param == "q[0][0][0][0][0][0][0]"
