"""From a request body to the key routing works on: the prompt's chained block hashes.

Token-exact when the gateway has the model's tokenizer (`--tokenizer`, or fetched from a worker's
`GET /tokenizer`): the chat template is rendered and the prompt tokenized exactly as the worker
will, then hashed in the worker's KV-event block size, so the gateway's trees and the worker's
events speak the same hashes. Without a tokenizer (or when the template rejects the messages and
the worker will answer the 4xx), the prompt's UTF-8 bytes are hashed in `text_block_bytes` blocks.
`cache_salt` is the hash namespace, as on the worker. The body is validated here: a malformed
request gets a 400 that names the field, before any worker sees it.

Only the first `max_prompt_chars` characters (or token ids) of a prompt are tokenized and hashed:
a longer prompt routes on that prefix (its tokens near the cut may differ from the whole
prompt's, so the last block is dropped), and its length is estimated for load balancing.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from radixpool.gateway.chat_tokens import ChatEncoder, encode_ids
from radixpool.protocol.kv_blocks import (
    DEFAULT_BLOCK_SIZE,
    as_token_array,
    prefix_block_hash_list,
)
from radixpool.tokenization import PromptTokenizer, template_tools

ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate")
BYTES_PER_TOKEN = 4  # text-mode estimate: sizing byte trees, comparing bytes with tokens
MAX_SEQUENCES = 1024  # a worker refuses a request for more choices (prompts x n) than this


class BadRequest(ValueError):
    """The request body is not what the endpoint accepts: the message says what, `param` which
    field (as the workers name it: `messages[0]`), `code` a machine-readable reason if any."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple:   # whole across processes (body_parsing's children)
        return type(self), (str(self), self.param, self.code)


@dataclass(slots=True)
class RouteKey:
    hashes: list[int]   # chained block hashes of the whole blocks of the prompt
    block_units: int    # tokens (exact) or bytes (text) per block
    units: int          # prompt length in tokens (exact) or bytes (text); estimated when cut
    exact: bool
    model: str | None
    head: bytes | np.ndarray | Sequence[int]  # the first `prefix_token_count` units
    salt: str | None
    sequences: int = 1  # what the worker runs for the body: each choice of each prompt

    @property
    def blocks(self) -> int:
        return len(self.hashes)

    @property
    def tokens(self) -> float:
        """The prompt's length in tokens (estimated from bytes in text mode)."""
        return self.units if self.exact else self.units / BYTES_PER_TOKEN

    @property
    def block_tokens(self) -> float:
        """Tokens per block (estimated from bytes in text mode)."""
        return self.block_units if self.exact else self.block_units / BYTES_PER_TOKEN

    @property
    def prefix_key(self) -> int:
        """Digest of the prompt's head, for the prefix_hash policy: computed on demand, so the
        other policies never pay for it."""
        head = self.head if isinstance(self.head, bytes) else _id_bytes(self.head)
        return _digest(head, self.salt)


class KeyBuilder:
    def __init__(self, text_block_bytes: int, prefix_token_count: int,
                 max_prompt_chars: int = 256 * 1024) -> None:
        self.text_block_bytes = text_block_bytes
        self.prefix_token_count = prefix_token_count
        self.max_prompt_chars = max_prompt_chars
        self.tokenizer: PromptTokenizer | None = None
        self.chat: ChatEncoder | None = None
        self.block_size = DEFAULT_BLOCK_SIZE
        self.block_size_known = False   # False: a guess until a worker reports its own
        self.generation = 0   # counts changes: copies in other processes are rebuilt from it

    def use_tokenizer(self, tokenizer: PromptTokenizer, block_size: int | None) -> None:
        """Route on token ids in blocks of `block_size` (None: the default, until a worker
        reports the block size it hashes in)."""
        self.tokenizer = tokenizer
        self.chat = ChatEncoder(tokenizer) if tokenizer.chat_template else None
        self.block_size = block_size or DEFAULT_BLOCK_SIZE
        self.block_size_known = block_size is not None
        self.generation += 1

    def settings(self) -> tuple:
        """What `from_settings` needs to build an equal KeyBuilder in another process."""
        files = self.tokenizer.files if self.tokenizer is not None else None
        return (self.text_block_bytes, self.prefix_token_count, self.max_prompt_chars, files,
                self.block_size)

    @classmethod
    def from_settings(cls, settings: tuple) -> KeyBuilder:
        text_block_bytes, prefix_token_count, max_prompt_chars, files, block_size = settings
        keys = cls(text_block_bytes, prefix_token_count, max_prompt_chars)
        if files is not None:
            keys.use_tokenizer(PromptTokenizer(files), block_size)
        return keys

    def build(self, path: str, doc: object) -> RouteKey:
        """The route key of a request body (a parsed JSON document); raises `BadRequest`."""
        if not isinstance(doc, dict):
            raise BadRequest("request body must be a JSON object")
        key = self._build(path, doc)
        key.sequences = _sequences(path, doc)
        return key

    def _build(self, path: str, doc: dict) -> RouteKey:
        model = doc.get("model")
        if model is not None and not isinstance(model, str):
            raise BadRequest("'model' must be a string", "model")
        salt = doc.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise BadRequest("'cache_salt' must be a string", "cache_salt")
        if path == "/v1/chat/completions":
            return self._chat(doc, model, salt)
        if path == "/v1/completions":
            if "prompt" not in doc:
                raise BadRequest("'prompt' is required", "prompt", "missing_field")
            return self._prompt(doc["prompt"], "prompt", model, salt)
        ids = doc.get("input_ids")
        if ids is not None:
            batch = isinstance(ids, list) and ids and isinstance(ids[0], list)
            param = _first_param("input_ids", ids if batch else None)
            # a batch routes on its first prompt
            return self._ids(ids[0] if batch else ids, "input_ids", model, salt, param)
        if "text" not in doc:
            raise BadRequest("'text' or 'input_ids' is required", "text", "missing_field")
        return self._prompt(doc["text"], "text", model, salt)

    def _chat(self, doc: dict, model: str | None, salt: str | None) -> RouteKey:
        if "messages" not in doc:
            raise BadRequest("'messages' is required", "messages", "missing_field")
        messages = doc["messages"]
        if not isinstance(messages, list) or not messages:   # null too: present, not missing
            raise BadRequest("'messages' must be a non-empty array", "messages")
        for i, m in enumerate(messages):   # named as the workers name them
            if not isinstance(m, dict):
                raise BadRequest(f"messages[{i}] must be an object", f"messages[{i}]")
            if "role" not in m:
                raise BadRequest(f"'messages[{i}].role' is required", f"messages[{i}].role",
                                 "missing_field")
            if not isinstance(m["role"], str):
                raise BadRequest(f"messages[{i}].role must be a string", f"messages[{i}].role")
        if self.chat is not None:
            kwargs = doc.get("chat_template_kwargs")
            kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
            try:
                if doc.get("tools"):   # rendered like the worker renders them
                    kwargs["tools"] = template_tools(doc["tools"])
                ids, cut = self.chat.encode_chat_prefix(
                    messages, doc.get("add_generation_prompt", True) is not False,
                    self.max_prompt_chars, **kwargs)
            except Exception:  # the worker will answer with its own 4xx; route on text meanwhile
                ids = None
            if ids is not None:
                return self._token_key(ids, model, salt, cut)
        text = "".join(f"{m['role']}\n{_content_text(m.get('content'))}\n" for m in messages)
        return self._text_key(text, model, salt)

    def _prompt(self, prompt: object, field: str, model: str | None, salt: str | None
                ) -> RouteKey:
        prompt, batch = _first(prompt, field)
        if isinstance(prompt, str):
            if self.tokenizer is not None:
                head = prompt[: self.max_prompt_chars]
                try:
                    ids = encode_ids(self.tokenizer, head, True)
                except TypeError:  # a lone surrogate ("\ud800" in the JSON) is no UTF-8 text
                    param = field if batch is None else f"{field}[0]"   # as the workers name it
                    raise BadRequest(f"'{param}' is not valid Unicode text: it holds a lone "
                                     f"UTF-16 surrogate", param) from None
                key = self._token_key(ids, model, salt, len(head) < len(prompt))
                if len(head) < len(prompt):
                    key.units = key.units * len(prompt) // len(head)
                return key
            return self._text_key(prompt, model, salt)
        return self._ids(prompt, field, model, salt, _first_param(field, batch))

    def _ids(self, ids: object, field: str, model: str | None, salt: str | None,
             prompt_param: str) -> RouteKey:
        """`prompt_param`: the field the workers name when the prompt is empty."""
        if isinstance(ids, list) and not ids:
            raise BadRequest("the prompt is empty", prompt_param)
        if not isinstance(ids, list):
            raise BadRequest(f"'{field}' must be a non-empty array of token ids", field)
        try:
            tokens = as_token_array(ids[: self.max_prompt_chars])
        except (TypeError, OverflowError) as exc:
            raise BadRequest(f"'{field}' must hold integer token ids", field) from exc
        key = self._token_key(tokens, model, salt)
        key.units = len(ids)
        return key

    def _token_key(self, tokens: np.ndarray | list[int], model: str | None, salt: str | None,
                   cut: bool = False) -> RouteKey:
        units = len(tokens)
        if cut:  # ids next to the cut may differ from the whole prompt's: route on whole blocks
            tokens = tokens[: max(0, len(tokens) - self.block_size)]
        hashes = prefix_block_hash_list(tokens, self.block_size, salt)
        return RouteKey(hashes, self.block_size, units, True, model,
                        tokens[: self.prefix_token_count], salt)

    def _text_key(self, text: str, model: str | None, salt: str | None) -> RouteKey:
        head = text[: self.max_prompt_chars]
        data = head.encode("utf-8", "surrogatepass")
        hashes = prefix_block_hash_list(data, self.text_block_bytes, salt)
        length = len(data) + len(text) - len(head)  # bytes, estimated past the cut
        return RouteKey(hashes, self.text_block_bytes, length, False, model,
                        data[: self.prefix_token_count * BYTES_PER_TOKEN], salt)


def _sequences(path: str, doc: dict) -> int:
    """The sequences a worker runs for the body, as its load report counts them: `n` choices of
    each prompt of a batch (`/generate`: each prompt's own `sampling_params.n` when they are a
    list). Values the worker will refuse count as 1; the count is capped at `MAX_SEQUENCES`."""
    if path == "/generate":
        batch = doc.get("input_ids")
        batch = doc.get("text") if batch is None else batch
        params = doc.get("sampling_params")
        if isinstance(params, list):
            total = sum(_choices(p.get("n") if isinstance(p, dict) else None)
                        for p in itertools.islice(params, MAX_SEQUENCES + 1))
        else:
            total = _choices(params.get("n") if isinstance(params, dict) else None)
            total *= _batch_size(batch)
    else:
        total = _choices(doc.get("n"))
        if path == "/v1/completions":
            total *= _batch_size(doc.get("prompt"))
    return max(1, min(total, MAX_SEQUENCES))


def _choices(n: object) -> int:
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def _batch_size(prompts: object) -> int:
    """Prompts in a prompt field: a list of strings or of id lists is a batch, else one."""
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list)):
        return len(prompts)
    return 1


def _first(value: object, field: str) -> tuple[object, list | None]:
    """A batch (`["a", "b"]` or `[[1, 2], [3]]`) routes on its first prompt: that prompt, and
    the batch (None for a single prompt)."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        return value[0], value
    if isinstance(value, (str, list)):
        return value, None
    raise BadRequest(f"'{field}' must be a string, an array of strings or of token ids", field)


def _first_param(field: str, batch: list | None) -> str:
    """The field the workers name for the first prompt's length: the prompt itself when it is
    the only one, else its place in the batch."""
    return f"{field}[0]" if batch is not None and len(batch) > 1 else field


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):   # text parts; anything else is the worker's to refuse
        return "".join(t for p in content if isinstance(p, dict)
                       and isinstance(t := p.get("text"), str))
    return ""


def _id_bytes(ids: np.ndarray | Sequence[int]) -> bytes:
    """Token ids as 8-byte little-endian words (the uint64 array's bytes, for a list too)."""
    return ids.tobytes() if isinstance(ids, np.ndarray) else array("q", ids).tobytes()


def _digest(data: bytes, salt: str | None) -> int:
    h = hashlib.blake2b(data, digest_size=8, person=b"rp-prefix")
    if salt:
        h.update(salt.encode())
    return int.from_bytes(h.digest(), "little")
