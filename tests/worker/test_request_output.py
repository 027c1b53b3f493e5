"""A request's chunks when a stop token ends it: the token is in the ids, its text is not."""

from __future__ import annotations

import pytest

from radixpool.tokenization import PromptTokenizer
from radixpool.worker.detokenizer import IncrementalDetokenizer
from radixpool.worker.messages import TokenDelta
from radixpool.worker.request_output import RequestOutput
from radixpool.worker.sampling_params import SamplingParams
from radixpool.worker.stop_strings import StopMatcher


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> PromptTokenizer:
    return PromptTokenizer.from_dir(tiny_model)


def run(tokenizer: PromptTokenizer, ids: list[int], **params) -> list:
    """Feed `ids` one per delta, the last ending the output on itself as a stop token."""
    sampling = SamplingParams(**params)
    out = RequestOutput("r", "r", 0, sampling, IncrementalDetokenizer(tokenizer),
                        StopMatcher(sampling.stop, sampling.no_stop_trim) if sampling.stop
                        else None, lambda chunk: None, 0.0)
    last = len(ids) - 1
    return [out.apply(TokenDelta("r", [t], finished=i == last,
                                 finish_reason="stop" if i == last else None,
                                 matched_stop_token=t if i == last else None))[0]
            for i, t in enumerate(ids)]


def test_a_stop_token_that_completes_a_held_character_leaves_that_character_out(tokenizer):
    # The stop token's text may be merged with bytes the detokenizer held back (the rest of a
    # character): the text is then that of the tokens before it, as SGLang decodes it.
    ids = tokenizer.encode("go ꙮ", add_special_tokens=False)
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd"), "ꙮ is split over tokens"
    chunks = run(tokenizer, ids)
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids[:-1])
    assert not any("ꙮ" in c.text for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == ids
    assert chunks[-1].trimmed_stop_token == ids[-1] and chunks[-1].completion_tokens == len(ids)
    kept = run(tokenizer, ids, no_stop_trim=True)
    assert "".join(c.text for c in kept) == "go ꙮ" and kept[-1].trimmed_stop_token is None


def test_a_stop_token_inside_a_matched_stop_string_is_trimmed_once(tokenizer):
    ids = tokenizer.encode("cache token", add_special_tokens=False)
    chunks = run(tokenizer, ids, stop=("che",))
    assert "".join(c.text for c in chunks) == "ca" and chunks[-1].matched_stop == "che"
