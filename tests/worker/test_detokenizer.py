"""Text egress: incremental detokenization and stop strings, on the tiny model's byte-level BPE and
on a SentencePiece-style tokenizer (metaspace with a dummy prefix, byte fallback: Llama-2,
Mistral)."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixpool.tokenization import PromptTokenizer
from radixpool.worker.detokenizer import (
    MAX_PENDING_TOKENS,
    PROMPT_CONTEXT_TOKENS,
    IncrementalDetokenizer,
)
from radixpool.worker.stop_strings import StopMatcher
from radixpool.worker.tiny_model import (
    _WORDS,
    SPECIAL_TOKENS,
    train_sentencepiece_tokenizer,
    train_tokenizer,
)

WORDS = ["東京", "🚀", "café", "naïve", "数据", "日本語", "😀🎉", "λ", "✓", "hello", " ", "\n",
         "cache token", "Observation:", "ü"]
TEXT = st.lists(
    st.one_of(st.sampled_from(WORDS),
              st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd"),
                      max_size=6)),
    max_size=12).map("".join).filter(lambda t: not any(s in t for s in SPECIAL_TOKENS))
SETTINGS = settings(max_examples=80, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> PromptTokenizer:
    return PromptTokenizer.from_dir(tiny_model)


@pytest.fixture(scope="module")
def sp_tokenizer() -> PromptTokenizer:
    return PromptTokenizer({"tokenizer.json": train_sentencepiece_tokenizer(0).to_str()})


@pytest.fixture(scope="module", params=["bpe", "sentencepiece"])
def each_tokenizer(request, sp_tokenizer) -> PromptTokenizer:
    if request.param == "bpe":
        return PromptTokenizer({"tokenizer.json": train_tokenizer(0).to_str()})
    return sp_tokenizer


def tokens(tok: PromptTokenizer, ids: list[int]) -> list[str]:
    return [tok.tokenizer.id_to_token(i) for i in ids]


def stream(detok: IncrementalDetokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    """Push `ids` in chunks at the given cut points; the flush comes last."""
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    pieces = [detok.push(ids[a:b]) for a, b in pairwise(bounds)]
    return [*pieces, detok.flush()]


def test_a_character_split_over_tokens_is_emitted_once_complete(tokenizer):
    ids = tokenizer.encode("日本語 ok", add_special_tokens=False)
    assert len(ids) > 4  # the characters really are split into byte tokens
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some token completed nothing and was held
    assert "".join(pieces) + detok.flush() == "日本語 ok"


def test_a_long_push_that_ends_inside_a_character(tokenizer):
    ids = tokenizer.encode("日本語のテキスト" * 20, add_special_tokens=False)
    cut = next(c for c in range(2 * MAX_PENDING_TOKENS, len(ids))
               if tokenizer.decode(ids[:c]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer)
    first, rest = detok.push(ids[:cut]), detok.push(ids[cut:])
    assert "\ufffd" not in first + rest
    assert first + rest + detok.flush() == "日本語のテキスト" * 20


@SETTINGS
@given(text=TEXT, cuts=st.lists(st.integers(0, 400), max_size=8), bos=st.booleans())
def test_streamed_text_equals_full_decode_and_never_breaks_utf8(tokenizer, text, cuts, bos):
    ids = tokenizer.encode(text, add_special_tokens=bos)
    pieces = stream(IncrementalDetokenizer(tokenizer), ids, cuts)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text


@SETTINGS
@given(ids=st.lists(st.integers(0, 1023), max_size=60),
       cuts=st.lists(st.integers(0, 100), max_size=6), skip=st.booleans())
def test_any_token_sequence_streams_to_its_full_decode(tokenizer, ids, cuts, skip):
    """Random ids (invalid byte sequences, special tokens): the stream still equals the decode."""
    pieces = stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=skip), ids, cuts)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_sentencepiece_tokenizer_has_a_dummy_prefix_and_byte_fallback(sp_tokenizer):
    ids = sp_tokenizer.encode("The cache Ω", add_special_tokens=False)
    assert tokens(sp_tokenizer, ids) == ["\u2581The", "\u2581cache", "\u2581", "<0xCE>", "<0xA9>"]
    assert sp_tokenizer.decode(ids[1:]) == "cache Ω"   # decoded alone, a leading space is lost


def test_a_completion_keeps_its_leading_space(sp_tokenizer):
    ids = sp_tokenizer.encode("The cache token world")
    prompt, completion = ids[:3], ids[3:]
    assert tokens(sp_tokenizer, completion) == ["\u2581token", "\u2581world"]
    for pushes in ([completion[:1], completion[1:]], [completion]):
        detok = IncrementalDetokenizer(sp_tokenizer, prompt_ids=prompt)
        assert "".join(detok.push(p) for p in pushes) + detok.flush() == " token world"


def test_a_space_after_a_skipped_special_token_is_kept(sp_tokenizer):
    hello, world = (sp_tokenizer.encode(w, add_special_tokens=False) for w in ("Hello", "world"))
    ids = [*hello, sp_tokenizer.token_id("<|im_end|>"), *world]
    assert tokens(sp_tokenizer, world) == ["\u2581world"]
    detok = IncrementalDetokenizer(sp_tokenizer)
    assert "".join(detok.push([t]) for t in ids) + detok.flush() == "Hello world" \
        == sp_tokenizer.decode(ids)


def test_pushing_tokens_together_or_one_by_one_gives_the_same_text(sp_tokenizer):
    # "L" alone is a character, but the byte run <0x4C><0xFD><0x3D> is not valid UTF-8 and
    # decodes to three U+FFFD: "L" may only be emitted once a non-byte token closes the run.
    ids = [sp_tokenizer.token_id(t) for t in ("<0x4C>", "<0xFD>", "<0x3D>")]
    ids += sp_tokenizer.encode("Hello world", add_special_tokens=False)
    expected = sp_tokenizer.decode(ids)
    assert expected.startswith("\ufffd" * 3)
    one = IncrementalDetokenizer(sp_tokenizer)
    together = IncrementalDetokenizer(sp_tokenizer)
    assert "".join(one.push([t]) for t in ids) + one.flush() == expected
    assert together.push(ids[:4]) + together.push(ids[4:]) + together.flush() == expected


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from(_WORDS), min_size=1, max_size=6),
       ids=st.lists(st.integers(0, 1023), max_size=40),
       cuts=st.lists(st.integers(0, 60), max_size=6), skip=st.booleans())
def test_streaming_equals_the_decode_with_prompt_context(each_tokenizer, words, ids, cuts, skip):
    """Random output ids after a real prompt, pushed in random chunks: the stream equals the
    decode of (prompt context + output) minus the context's own text, and pushing the same ids
    one by one gives the same pieces' concatenation. U+FFFD appears only where the full decode
    has it (never a character broken across pushes)."""
    tok = each_tokenizer
    prompt = tok.encode(" ".join(words))
    context = prompt[-PROMPT_CONTEXT_TOKENS:]
    full = tok.decode(context + ids, skip_special_tokens=skip)
    before = tok.decode(context, skip_special_tokens=skip)
    assert full.startswith(before)
    chunked = stream(IncrementalDetokenizer(tok, skip, prompt), ids, cuts)
    single = stream(IncrementalDetokenizer(tok, skip, prompt), ids, list(range(len(ids))))
    assert "".join(chunked) == "".join(single) == full[len(before):]


@pytest.mark.parametrize("prompt_text", ["Reply 🎉", "🎉🎉", "Reply to this 😀🎉", "naïve 数据 ✓"])
def test_a_prompt_ending_in_byte_tokens_keeps_the_completions_leading_space(each_tokenizer,
                                                                            prompt_text):
    """A SentencePiece prompt ending in byte-fallback tokens (an emoji) left no usable context in
    front of the output, whose first word then lost its space (the decoder strips the text's
    first one): " cache token" came out as "cache token"."""
    tok = each_tokenizer
    prompt = tok.encode(prompt_text)
    out = tok.encode("cache token 🚀 ok", add_special_tokens=False)
    expected = tok.decode(prompt + out)[len(tok.decode(prompt)):]
    for cuts in ([], list(range(len(out)))):
        assert "".join(stream(IncrementalDetokenizer(tok, True, prompt), out, cuts)) == expected
    if tok.byte_fallback_ids:
        assert expected.startswith(" cache token")


def test_special_tokens_shown_or_skipped(tokenizer):
    ids = [*tokenizer.encode("hi"), tokenizer.eos_token_id]
    shown = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(shown.push([t]) for t in ids) + shown.flush() == "<s>hi</s>"
    skipped = IncrementalDetokenizer(tokenizer)
    assert "".join(skipped.push([t]) for t in ids) + skipped.flush() == "hi"


def test_each_push_decodes_a_small_window(tokenizer):
    class Counting(PromptTokenizer):
        widest = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.widest = max(Counting.widest, len(ids))
            return super().decode(ids, skip_special_tokens)

    ids = tokenizer.encode("東京 café 🚀 日本語のテキスト " * 40)
    pieces = stream(IncrementalDetokenizer(Counting(tokenizer.files)), ids, list(range(len(ids))))
    assert "".join(pieces) == tokenizer.decode(ids)
    assert len(ids) > 400 and Counting.widest <= 8


def test_a_stream_of_invalid_bytes_keeps_the_window_bounded(tokenizer):
    """A broken model emitting only stray bytes: nothing ever completes, the cost stays linear."""
    stray = next(t for t in range(tokenizer.vocab_size)
                 if tokenizer.decode([t, t]) == "\ufffd\ufffd")
    widest = 0

    class Counting(PromptTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            nonlocal widest
            widest = max(widest, len(ids))
            return super().decode(ids, skip_special_tokens)

    detok = IncrementalDetokenizer(Counting(tokenizer.files))
    text = "".join(detok.push([stray]) for _ in range(500)) + detok.flush()
    assert text == "\ufffd" * 500
    assert widest <= 2 * (MAX_PENDING_TOKENS + 1)


def test_stop_string_split_across_chunks_is_trimmed():
    matcher = StopMatcher(("Observation:",))
    out = [matcher.feed(c) for c in ("Thought: go", " Obs", "erv", "ation: 42", " more")]
    assert [o.text for o in out] == ["Thought: go", " ", "", "", ""]
    assert out[3].stop == "Observation:" and out[4].stop == "Observation:"
    assert matcher.flush() == ""


def test_held_prefix_is_released_when_it_is_not_a_stop():
    matcher = StopMatcher(("abc", "xyz"))
    assert matcher.feed("1ab") == ("1", None)
    assert matcher.feed("d x") == ("abd ", None)
    assert matcher.flush() == "x"


def test_the_stop_completed_first_wins():
    matcher = StopMatcher(("END", "\n\n", "D"))
    assert matcher.feed("one\n") == ("one", None)
    assert matcher.feed("\nEND") == ("", "\n\n")
    assert StopMatcher(("a", "xaa")).feed("xaa") == ("x", "a")


@settings(max_examples=300, deadline=None)
@given(text=st.text("abc\nxy", max_size=40),
       stops=st.lists(st.text("abc\nxy", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_stop_matching_is_independent_of_chunking(text, stops, cuts):
    """Reference: the stop completed first on the whole text (earliest end, then longest)."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    end = min(hits)[1] if hits else len(text)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    matcher = StopMatcher(stops)
    emitted, stop = "", None
    for a, b in pairwise(bounds):
        check = matcher.feed(text[a:b])
        emitted += check.text
        stop = stop or check.stop
    emitted += matcher.flush()
    assert emitted == text[:end]
    assert stop == (min(hits)[2] if hits else None)


def test_a_stop_held_back_by_the_minimum_counts_only_where_it_ends_after_it():
    matcher = StopMatcher(("ab",))
    assert matcher.feed("xab", may_stop=False) == ("xab", None)   # ends before the minimum
    assert matcher.feed("a", may_stop=False) == ("", None)        # may start a stop: held
    assert matcher.feed("b!") == ("", "ab")                       # ...that ends after it
    nested = StopMatcher(("a", "xab"))
    assert nested.feed("xa", may_stop=False) == ("", None)
    assert nested.feed("b") == ("", "xab")   # "a" ended inside the quiet text: it does not count


@settings(max_examples=300, deadline=None)
@given(text=st.text("abc\nxy", max_size=40),
       stops=st.lists(st.text("abc\nxy", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8), quiet=st.integers(0, 40))
def test_stops_held_back_until_the_minimum_do_not_depend_on_chunking(text, stops, cuts, quiet):
    """Reference: the first stop (earliest end, then longest) that ends after the first `quiet`
    characters, which were fed with may_stop=False."""
    quiet = quiet % (len(text) + 1)
    hits = [(end, -len(s), s) for end in range(quiet + 1, len(text) + 1) for s in stops
            if text[:end].endswith(s)]
    first = min(hits) if hits else None
    bounds = sorted({0, quiet, len(text), *(c % (len(text) + 1) for c in cuts)})
    matcher = StopMatcher(stops)
    emitted, stop = "", None
    for a, b in pairwise(bounds):
        check = matcher.feed(text[a:b], may_stop=a >= quiet)
        emitted += check.text
        stop = stop or check.stop
    emitted += matcher.flush()
    assert emitted == (text[:first[0] + first[1]] if first else text)
    assert stop == (first[2] if first else None)


def test_stop_string_split_across_tokens(tokenizer):
    text = "The capital is 東京. Then more text"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, matcher = IncrementalDetokenizer(tokenizer), StopMatcher(("京.", "none"))
    emitted, stop = "", None
    for t in ids:
        check = matcher.feed(detok.push([t]))
        emitted += check.text
        stop = stop or check.stop
    assert stop == "京." and emitted == "The capital is 東"


def test_empty_stop_strings_are_rejected():
    with pytest.raises(ValueError, match="stop"):
        StopMatcher(("ok", ""))
