"""The OpenAI-compatible API, driven with the official `openai` SDK against a real worker."""

from __future__ import annotations

import uuid

import openai
import pytest

pytestmark = pytest.mark.slow

WORDS = ("river", "mountain", "city", "winter", "garden", "music", "paper", "window", "story",
         "market", "engine")


def fresh_text(n_words: int = 40) -> str:
    """A prompt no other test sent (so nothing of it is cached yet)."""
    tag = uuid.uuid4().int
    return " ".join(WORDS[(tag >> (3 * i)) % len(WORDS)] for i in range(n_words))


def chat(client, content: str, **kw):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], **kw)


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_completion(client):
    r = chat(client, "hello there", max_tokens=8, temperature=0, user="user-1",
             frequency_penalty=0.5, presence_penalty=0.5)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == "tiny"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_matches_non_stream(client):
    kw = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = chat(client, "stream me a story", **kw)
    chunks = list(chat(client, "stream me a story", stream=True,
                       stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_stream_and_batch(client):
    r = client.completions.create(model="tiny", prompt=["one two", "three four"], max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 10
    stream = client.completions.create(model="tiny", prompt="one two", max_tokens=5,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == next(c.text for c in r.choices if c.index == 0)


def test_n_choices(client):
    r = chat(client, "pick a word", n=3, max_tokens=6, temperature=1.0, seed=7,
             extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    streamed = list(chat(client, "pick a word", n=3, max_tokens=6, temperature=1.0, seed=7,
                         stream=True, extra_body={"ignore_eos": True}))
    per_choice = {i: "" for i in range(3)}
    for c in streamed:
        for ch in c.choices:
            per_choice[ch.index] += ch.delta.content or ""
    assert per_choice == {c.index: c.message.content for c in r.choices}


QWEN_STYLE_TEMPLATE = (   # Qwen2.5's and Qwen3's rule: a role it does not know prints nothing
    "{% for m in messages %}{% if m.role in ('system', 'user', 'assistant') %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}")


def test_a_developer_message_is_the_system_prompt(client, http):
    """OpenAI's `developer` role (its name for the system prompt since o1) reached the chat
    template as it came: Qwen's templates, which know no such role, dropped the message
    without a word, and the tiny model's printed a `developer` turn no model was trained on.
    It is the system prompt now, tools or not, for a template that does not name the role."""
    from radixpool.tokenization import PromptTokenizer

    tool = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
    for extra in ({}, {"tools": [tool], "tool_choice": "none"}):
        replies = [client.chat.completions.create(
            model="tiny", messages=[{"role": role, "content": "answer in French"},
                                    {"role": "user", "content": "hello"}],
            max_tokens=6, temperature=0, extra_body={"ignore_eos": True}, **extra)
            for role in ("system", "developer")]
        assert replies[1].usage.prompt_tokens == replies[0].usage.prompt_tokens
        assert replies[1].choices[0].message.content == replies[0].choices[0].message.content
    files = {**http.get("/tokenizer").json()["files"], "chat_template.jinja": QWEN_STYLE_TEMPLATE}
    rendered = PromptTokenizer(files).render_chat(
        [{"role": "developer", "content": "answer in French"}, {"role": "user", "content": "hi"}])
    assert "<|im_start|>system\nanswer in French" in rendered


def test_web_search_asked_for_with_its_defaults_is_refused(client):
    """`web_search_options={}` is how OpenAI's own example turns web search on (each of its
    options has a default): it was taken for unset, and the model answered alone, unsearched."""
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, "what is in the news today?", max_tokens=2, web_search_options={})
    assert refused.value.body["param"] == "web_search_options"
    assert "web search is not supported" in refused.value.body["message"]


def test_a_bad_token_id_is_named_where_it_is(client):
    """Token ids with one negative id (a -1 pad, a -100 label) were answered "(prompt[0]: Input
    should be a valid string)": the first form the prompt's union tried, not the form sent."""
    for prompt, where in (([5, 6, -1], "prompt[2]"), ([[5], [6, -100]], "prompt[1][1]"),
                          ([-1], "prompt[0]")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        assert refused.value.body["param"] == "prompt"
        assert f"({where}: Input should be greater than or equal to 0)" in \
            refused.value.body["message"]


def test_seed_reproducible(client):
    kw = {"max_tokens": 16, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    a = chat(client, "tell me something", seed=1234, **kw).choices[0].message.content
    b = chat(client, "tell me something", seed=1234, **kw).choices[0].message.content
    c = chat(client, "tell me something", seed=4321, **kw).choices[0].message.content
    assert a == b
    assert a != c


def test_stop_string_spanning_tokens_is_trimmed(client, http):
    from radixpool.tokenization import PromptTokenizer

    tokenizer = PromptTokenizer(http.get("/tokenizer").json()["files"])
    prompt = "the garden and the river"
    base = http.post("/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}).json()
    text, ids = base["text"], base["output_ids"]
    # a stop string made of the last character of one token and the first of the next
    stop = None
    for i in range(len(ids) - 2, 1, -1):
        k = len(tokenizer.decode(ids[:i]))
        piece = text[k - 1:k + 1]
        if text.startswith(tokenizer.decode(ids[:i])) and len(piece) == 2 and "\ufffd" not in piece:
            stop = piece
            break
    assert stop, f"no token boundary to stop on in {text!r}"
    expected = text[: text.index(stop)]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                         temperature=0, stop=stop, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_a_stop_token_text_is_left_out_unless_asked_for(client, http):
    # vLLM and SGLang leave the text of a matched stop_token_id (and of a shown EOS) out of the
    # answer, streamed or not, while usage counts the token: it was appended to the text here.
    prompt = "the river and the garden"
    base = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    free = http.post("/generate", json={"text": prompt, "sampling_params": base}).json()
    token = free["output_ids"][2]
    before, upto = (http.post("/generate", json={"text": prompt, "sampling_params": {
        **base, "max_new_tokens": k}}).json()["text"] for k in (2, 3))
    assert upto != before
    kw = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    stop = {"ignore_eos": True, "stop_token_ids": [token]}
    r = client.completions.create(n=2, logprobs=1, extra_body=stop, **kw)
    for choice in r.choices:
        assert choice.text == before and choice.finish_reason == "stop"
        lp = choice.logprobs   # the stop token keeps its entry, taking no room in the text
        assert len(lp.tokens) == 3 and lp.text_offset[-1] <= len(before)
    assert r.usage.completion_tokens == 6
    streamed = list(client.completions.create(stream=True, extra_body=stop, **kw))
    assert "".join(c.choices[0].text for c in streamed) == before
    assert streamed[-1].choices[0].finish_reason == "stop"
    kept = client.completions.create(extra_body={**stop, "include_stop_str_in_output": True},
                                     **kw)
    assert kept.choices[0].text == upto
    native = http.post("/generate", json={"text": prompt, "sampling_params": {
        **base, "stop_token_ids": [token]}}).json()
    assert native["text"] == before and native["output_ids"][-1] == token
    native = http.post("/generate", json={"text": prompt, "sampling_params": {
        **base, "stop_token_ids": [token], "no_stop_trim": True}}).json()
    assert native["text"] == upto


def test_a_shown_eos_that_ends_the_output_is_left_out_of_the_message(client):
    eos_first = {"2": 100}   # </s>, the tiny model's EOS, made certain after min_tokens
    kw = {"max_tokens": 6, "temperature": 0, "logit_bias": eos_first, "logprobs": True}
    shown = {"skip_special_tokens": False, "min_tokens": 2}
    r = chat(client, "the cat", extra_body=shown, **kw)
    content = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3
    assert not content.endswith("</s>")
    entries = r.choices[0].logprobs.content   # they spell the message: none for the trimmed EOS
    assert b"".join(bytes(e.bytes) for e in entries).decode(errors="replace") == content
    chunks = list(chat(client, "the cat", stream=True, extra_body=shown, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
    kept = chat(client, "the cat", extra_body={**shown, "include_stop_str_in_output": True},
                **kw)
    assert kept.choices[0].message.content == content + "</s>"
    stops = chat(client, "the cat", stop=[content[-2:]], max_tokens=6, temperature=0,
                 extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert stops.choices[0].message.content.endswith(content[-2:])


def test_logprobs(client):
    r = chat(client, "hello", max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
             extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    legacy = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0,
                                       logprobs=2, extra_body={"ignore_eos": True})
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_cover_the_message_not_the_end_of_turn(client):
    # OpenAI's logprobs.content lists the message's tokens; the end-of-turn token that ended the
    # output (no part of the message) was listed too, so the entries did not spell the message
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    kw = {"max_tokens": 40, "temperature": 0, "logprobs": True, "response_format": {
        "type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    r = chat(client, "answer", **kw)   # the schema ends the output with the end of turn
    assert r.choices[0].finish_reason == "stop"
    content = r.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content
    streamed = [e.token for c in chat(client, "answer", stream=True, **kw)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]


def test_logprobs_of_special_tokens_the_text_skips(client):
    # A special token inside the output (here <s>, made likely by a logit bias) is skipped by
    # the text: completions still counted its characters in every later text_offset, and chat
    # listed it, so the entries' bytes no longer spelled the message.
    kw = {"max_tokens": 16, "temperature": 1.0, "logit_bias": {"1": 6}}
    for seed in range(8):
        r = client.completions.create(model="tiny", prompt="the cat", seed=seed, logprobs=0,
                                      **kw)
        lp, text = r.choices[0].logprobs, r.choices[0].text
        if "<s>" in lp.tokens[:-1]:
            break
    else:
        pytest.fail("no seed put <s> inside the output")
    assert "<s>" not in text and max(lp.text_offset) <= len(text)
    for token, at in zip(lp.tokens, lp.text_offset, strict=True):
        if token != "<s>" and not token.startswith("bytes:"):
            assert text.startswith(token, at), (token, at, text)
    streamed = client.completions.create(model="tiny", prompt="the cat", seed=seed, logprobs=0,
                                         stream=True, **kw)
    assert [at for c in streamed for at in c.choices[0].logprobs.text_offset] == lp.text_offset

    for skip in (True, False):
        r = chat(client, "the cat", seed=seed, logprobs=True,
                 extra_body={"skip_special_tokens": skip}, **kw)
        content, entries = r.choices[0].message.content, r.choices[0].logprobs.content
        assert ("<s>" in content) is not skip
        assert b"".join(bytes(e.bytes) for e in entries).decode(errors="replace") == content


def test_repeated_prompt_reports_cached_tokens(client):
    text, salt = fresh_text(), uuid.uuid4().hex   # a namespace of its own: nothing cached yet
    kw = {"max_tokens": 4, "temperature": 0, "extra_body": {"cache_salt": salt}}
    first = chat(client, text, **kw)
    second = chat(client, text, **kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    prompt = second.usage.prompt_tokens
    assert prompt - 2 <= cached < prompt   # all but the token that must be recomputed


def test_cache_salt_separates_namespaces(client):
    text, a, b = fresh_text(), uuid.uuid4().hex, uuid.uuid4().hex
    chat(client, text, max_tokens=2, extra_body={"cache_salt": a})
    other = chat(client, text, max_tokens=2, extra_body={"cache_salt": b})
    same = chat(client, text, max_tokens=2, extra_body={"cache_salt": a})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens > 0


def test_extensions_are_accepted(client):
    r = chat(client, "hi", max_tokens=4, temperature=0.7,
             extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
                         "min_tokens": 4})
    assert r.usage.completion_tokens == 4
    r = chat(client, "hi", max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_fields_openai_makes_nullable_take_null_as_their_default(client):
    """The SDK sends a parameter given as None as JSON null, and OpenAI's API makes `n`,
    `stream`, `logprobs` and `echo` nullable: they were refused with a 400."""
    r = chat(client, "hi", max_tokens=3, n=None, stream=None, logprobs=None, top_logprobs=None,
             temperature=0)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None
    assert r.choices[0].message.content == chat(client, "hi", max_tokens=3,
                                                temperature=0).choices[0].message.content
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=2, n=None, stream=None,
                                  echo=None, logprobs=None, temperature=0)
    plain = client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
    echoed = client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0,
                                       echo=True)
    assert len(r.choices) == 1 and r.choices[0].text == plain.choices[0].text
    assert echoed.choices[0].text == "hi" + plain.choices[0].text   # null is not echo


def test_values_openai_accepts_are_accepted(client):
    """Values inside OpenAI's documented ranges that were refused with a 400: `top_p` 0 (its
    range is [0, 1]; the nucleus of mass 0 is the likeliest token alone), `modalities`
    ["text"] (OpenAI's default), and `stream_options.include_obfuscation`."""
    sampled = {"max_tokens": 6, "temperature": 1.5, "extra_body": {"ignore_eos": True}}
    greedy = chat(client, "hi", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    for seed in (1, 2):
        r = chat(client, "hi", top_p=0, seed=seed, **sampled)
        assert r.choices[0].message.content == greedy.choices[0].message.content
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=2, top_p=0)
    assert r.usage.completion_tokens >= 1
    r = chat(client, "hi", max_tokens=2, modalities=["text"])
    assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(chat(client, "hi", max_tokens=2, stream=True, stream_options={
        "include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage.completion_tokens >= 1


def test_logit_bias_steers_the_output(client, http):
    from radixpool.tokenization import PromptTokenizer

    tokenizer = PromptTokenizer(http.get("/tokenizer").json()["files"])
    token = 300
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0,
                                  logit_bias={str(token): 100}, logprobs=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs.tokens == [tokenizer.decode([token])] * 4


def test_echo_prepends_the_prompt_streamed_or_not(client):
    prompt = fresh_text(8)
    greedy = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0}
    plain = client.completions.create(**greedy).choices[0].text
    echoed = client.completions.create(**greedy, echo=True).choices[0].text
    assert echoed == prompt + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **greedy, echo=True, stream=True) if c.choices)
    assert streamed == prompt + plain


def test_server_timing_reports_the_engine_share_of_the_latency(client, http):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": fresh_text(20)}], max_tokens=4)
    name, _, duration = raw.headers["server-timing"].partition(";dur=")
    assert name == "engine" and 0 < float(duration) < raw.elapsed.total_seconds() * 1000
    raw = client.completions.with_raw_response.create(model="tiny", prompt=["a b", "c d"],
                                                      max_tokens=2)
    assert raw.headers["server-timing"].startswith("engine;dur=")
    r = http.post("/generate", json={"text": fresh_text(5), "sampling_params": {
        "max_new_tokens": 2}})
    assert r.status_code == 200 and r.headers["server-timing"].startswith("engine;dur=")


def test_min_tokens_holds_back_stop_strings(client, http):
    prompt = "hello world"
    free = http.post("/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 30, "temperature": 0, "ignore_eos": True}}).json()["text"]
    stop = free.lstrip()[:1] or free[:1]    # a character that occurs at once
    args = {"model": "tiny", "prompt": prompt, "max_tokens": 30, "temperature": 0,
            "stop": [stop]}
    early = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert early.usage.completion_tokens < 10   # without a minimum the stop ends it at once
    held = client.completions.create(**args, extra_body={"ignore_eos": True, "min_tokens": 10})
    assert held.usage.completion_tokens >= 10
    text, reason = held.choices[0].text, held.choices[0].finish_reason
    assert free.startswith(text + stop if reason == "stop" else text)
    streamed = client.completions.create(**args, stream=True, stream_options={
        "include_usage": True}, extra_body={"ignore_eos": True, "min_tokens": 10})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == held.usage.completion_tokens
