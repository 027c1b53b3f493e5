"""Prompt tokenization shared by the worker and the gateway.

Both sides must turn a request into the *same* token ids, or the gateway's prefix trees would be
matching something the worker never sees. So both use this one class: the `tokenizers` library
(no torch, no transformers) plus the model's own Jinja chat template, rendered the way Hugging Face
`transformers` renders it (sandboxed, `trim_blocks`/`lstrip_blocks`, `raise_exception`). A worker
serves its files at `GET /tokenizer`; a gateway can build the identical tokenizer from them.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def template_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI `tools` as chat templates get them: function tools only, keys in one order, unset
    keys dropped. The worker and the gateway both render through this, so a client's key order or
    explicit nulls cannot make their token ids differ."""
    out = []
    for tool in tools:
        function = tool["function"]
        out.append({"type": "function", "function": {
            key: function[key] for key in ("name", "description", "parameters")
            if function.get(key) is not None}})
    return out


GIL_FREE_ENCODE_CHARS = 16 << 10   # longer texts are tokenized with the GIL released
# What every chat template gets from `render_chat` (and Jinja's own globals): a request's
# `chat_template_kwargs` may not replace one, or a client's value would stand in for its messages,
# its special tokens or the template's own checks.
RENDERER_VARIABLES = frozenset({
    "messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
    "raise_exception", "strftime_now",
    "range", "dict", "lipsum", "cycler", "joiner", "namespace"})   # jinja2.defaults


class ToolArguments(dict):
    """A tool call's `arguments` as chat templates get them: the object its JSON text parses to
    (Llama 3's templates write `arguments | tojson`, others iterate it), which prints, and turns
    to JSON, as that text. An OpenAI client sends the text; passed as a string, `| tojson` wrote
    it back quoted (`"parameters": "{\\"n\\": 3}"`), not as the object the model wrote."""

    def __init__(self, text: str, value: dict[str, Any]) -> None:
        super().__init__(value)
        self.text = text

    def __str__(self) -> str:
        return self.text


def _template_messages(messages: list[dict], developer_role: bool) -> list[dict]:
    """`messages` with each assistant tool call's JSON-text `arguments` as `ToolArguments`, and,
    unless the template names the `developer_role`, a `developer` message (OpenAI's name for the
    system prompt since o1) as a `system` one: Qwen's templates print nothing for a role they do
    not know, so the instructions were dropped without a word."""
    out = []
    for message in messages:
        if message.get("role") == "developer" and not developer_role:
            message = {**message, "role": "system"}
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            message = {**message, "tool_calls": [_template_call(call) for call in calls]}
        out.append(message)
    return out


def _template_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    text = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(text, str):
        return call
    try:
        value = json.loads(text)
    except ValueError:
        return call
    if not isinstance(value, dict):
        return call
    return {**call, "function": {**function, "arguments": ToolArguments(text, value)}}


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (e.g. roles out of order)."""


def _special_token(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):
        return value.get("content")
    return value


class PromptTokenizer:
    def __init__(self, files: dict[str, str]) -> None:
        if "tokenizer.json" not in files:
            raise ValueError("tokenizer files must include tokenizer.json")
        self.files = dict(files)
        self.tokenizer = Tokenizer.from_str(files["tokenizer.json"])
        self.config: dict[str, Any] = json.loads(files.get("tokenizer_config.json", "{}"))
        template = self.config.get("chat_template")
        if "chat_template.jinja" in files:
            template = files["chat_template.jinja"]
        named: dict[str, str] = {}
        if isinstance(template, list):  # named templates (Hermes 2 Pro / Hermes 3, Command R)
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        self.chat_template: str | None = template
        # As transformers does, a chat with tools renders through the "tool_use" template when
        # the model has one (its "default" may not mention tools at all).
        self.tool_use_template: str | None = named.get("tool_use")
        self._compiled: dict[str, Any] = {}
        self.bos_token = _special_token(self.config, "bos_token")
        self.eos_token = _special_token(self.config, "eos_token")

    @classmethod
    def from_dir(cls, path: str | Path) -> PromptTokenizer:
        path = Path(path)
        names = (*TOKENIZER_FILES, "chat_template.jinja")
        files = {n: (path / n).read_text() for n in names if (path / n).is_file()}
        return cls(files)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of the `<0x00>`..`<0xFF>` tokens of a byte-fallback model (SentencePiece style);
        empty for other tokenizers. A run of them decodes as one byte string."""
        model = json.loads(self.files["tokenizer.json"]).get("model", {})
        if not model.get("byte_fallback"):
            return frozenset()
        ids = (self.tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens (those `skip_special_tokens` drops)."""
        added = self.tokenizer.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    @cached_property
    def longest_token_chars(self) -> int:
        """The longest token's length as the vocabulary spells it (a byte per character for
        byte-level BPE): no token covers more characters of a text, bar normalizers that drop
        characters."""
        return max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > GIL_FREE_ENCODE_CHARS:
            # `encode` holds the GIL for the whole call (2 s for a 2 MB chat on a 2-vCPU
            # machine): on a thread beside an event loop, every stream on it stood still that
            # long. `encode_batch` gives the same ids and releases it.
            batch = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
            return batch[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _compiled_template(self, source: str):
        if source not in self._compiled:
            self._compiled[source] = self._environment.from_string(source)
        return self._compiled[source]

    @cached_property
    def _environment(self):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            if isinstance(value, ToolArguments) and (indent, separators, sort_keys) == (
                    None, None, False):
                return value.text   # the call as the model wrote it
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **extra: Any) -> str:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        from jinja2.exceptions import TemplateError

        source = self.chat_template
        if extra.get("tools") is not None and self.tool_use_template:
            source = self.tool_use_template
        try:
            return self._compiled_template(source).render(
                messages=_template_messages(messages, "developer" in source),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **extra: Any) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)
