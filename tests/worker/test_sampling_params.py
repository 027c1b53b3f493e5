"""SamplingParams: every bad field is a ValueError that names it; good input is normalised."""

from __future__ import annotations

import pytest

from radixpool.worker.sampling_params import SamplingParams


@pytest.mark.parametrize(("doc", "field"), [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": 5.0}, "max_new_tokens"),
    ({"max_new_tokens": "5"}, "max_new_tokens"),
    ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": False}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),   # overflowed a logit: 500
    ({"repetition_penalty": 0.009}, "repetition_penalty"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": ["ok", None]}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": ["7"]}, "stop_token_ids"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
    ({"temprature": 0.5}, "temprature"),
    ({"json_schema": '{"a":' * 5000 + "1" + "}" * 5000}, "json_schema"),   # a RecursionError
])
def test_bad_field_is_rejected_by_name(doc, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(doc)


def test_direct_construction_is_validated_too():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"3": 1.0})


def test_non_object_is_rejected():
    with pytest.raises(ValueError, match="sampling_params"):
        SamplingParams.from_dict([("temperature", 1.0)])


def test_json_shapes_are_normalised():
    p = SamplingParams.from_dict({
        "stop": "###", "stop_token_ids": [7, 8], "logit_bias": {"12": 5, 13: -100},
        "temperature": None, "seed": 42, "logprobs": 0, "max_new_tokens": 16})
    assert p.stop == ("###",)
    assert p.stop_token_ids == (7, 8)
    assert p.logit_bias == {12: 5.0, 13: -100.0}
    assert p.temperature == SamplingParams().temperature
    assert (p.seed, p.logprobs, p.max_new_tokens) == (42, 0, 16)
    assert SamplingParams(stop="END").stop == ("END",)  # one string is one stop, not 3 letters
    assert SamplingParams.from_dict({"stop": ["a", "b"]}).stop == ("a", "b")
    assert SamplingParams.from_dict(None) == SamplingParams()


def test_greedy_and_vocabulary_checks():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.7).greedy
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1024: 1.0}).check_vocab(1024)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(5000,)).check_vocab(1024)
    SamplingParams(logit_bias={1023: 1.0}, stop_token_ids=(0,)).check_vocab(1024)
