"""A routed request's body to its route key: small bodies in place, large ones in child processes.

`json.loads` holds the GIL for the whole parse, and its cost grows with the number of values in
the body, not only its size: 32 MiB of `{"x": [[1], [1], ...]}` takes seconds and more than half
a GiB, while 32 MiB of one prompt string takes 70 ms. Rendering a chat template is Python too.
Done in the gateway's own process, on a thread or not, such a body stops every other request for
as long as it takes, and two at once can take the gateway past its memory limit.

So bodies above `INLINE_BODY_BYTES` are parsed, validated and keyed in `--parse-processes` child
processes (`radixpool.child_pool`: started on the first large body, and again whenever the keys
change, e.g. when a worker's tokenizer arrives). The event loop only hands the bytes over and gets
back the route key and the body to forward. A body that cannot be parsed within
`--parse-memory-bytes` gets a 413; one whose objects hold more than `MAX_OBJECT_MEMBERS` keys in
all gets a 400 (`radixpool.json_members`) instead of going on to a worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from radixpool.child_pool import ChildPool, TooBig
from radixpool.gateway.route_key import BadRequest, KeyBuilder, RouteKey
from radixpool.json_depth import MAX_DEPTH, too_deep
from radixpool.json_members import MAX_OBJECT_MEMBERS, members_exceed, too_many_members_message

INLINE_BODY_BYTES = 16 * 1024  # worst case in place: a few ms of parsing and tokenization
USAGE_OPTION = b'"stream_options":{"include_usage":true},'
DEPTH_WALK_VALUES = 50_000  # values a depth check looks at: ~20 ms, in a parse process (> 16 KiB)


class BodyTooComplex(Exception):
    """The body could not be parsed within the parse processes' memory or time limit: 413."""


@dataclass(slots=True)
class ParsedBody:
    key: RouteKey
    body: bytes         # what the worker is sent
    strip_usage: bool   # the stream's usage event was asked for by the gateway, not the client


def parse_body(keys: KeyBuilder, path: str, body: bytes) -> ParsedBody:
    """Validate a routed request's body and build its route key; raises `BadRequest`.

    Streams ask the worker for `stream_options.include_usage`, so every answer reports
    `cached_tokens`: the option is spliced in (no re-encoding) when the client sent none."""
    try:
        # UTF-8 only (RFC 8259): `json.loads(bytes)` would also take UTF-16 and -32, which the
        # splice below and the workers do not
        doc = json.loads(body.decode("utf-8"))
    except RecursionError:
        found = too_deep(body.decode("utf-8"))
        raise BadRequest(found.message() if found else
                         "request body is not valid JSON: it nests too deeply",
                         param=found.param if found else None, code="invalid_json") from None
    except ValueError as exc:  # (UnicodeDecodeError is a ValueError)
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if body.count(b":") > MAX_OBJECT_MEMBERS and members_exceed(doc, MAX_OBJECT_MEMBERS):
        raise BadRequest(too_many_members_message(), code="too_many_members")
    key = keys.build(path, doc)
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and _deeper_than(doc, MAX_DEPTH):
        # parsed here (Python's limit is near 1,000), but no endpoint takes it: the workers'
        # parser stops past 200, so it is refused here, as they would word it
        found = too_deep(body.decode("utf-8"))
        raise BadRequest(found.message() if found else
                         f"request body is not valid JSON: it nests more than {MAX_DEPTH} "
                         "levels deep", param=found.param if found else None,
                         code="invalid_json")
    if doc.get("stream") is not True or path == "/generate":
        return ParsedBody(key, body, False)
    if "stream_options" not in doc:  # the object has a "stream" member: open it with the option
        start = body.index(b"{") + 1
        return ParsedBody(key, body[:start] + USAGE_OPTION + body[start:], True)
    options = doc["stream_options"]
    # only a missing or false option is ours to set: any other value (null, 0, "") is the
    # client's to have refused by the worker, as it would be without the gateway
    if options is None or (isinstance(options, dict)
                           and options.get("include_usage", False) is False):
        # re-encoded: a member the client wrote after a spliced one would override it
        doc["stream_options"] = {**(options or {}), "include_usage": True}
        return ParsedBody(key, json.dumps(doc).encode(), True)
    return ParsedBody(key, body, False)


def _deeper_than(doc: object, limit: int, budget: int = DEPTH_WALK_VALUES) -> bool:
    """Whether some object or array in `doc` sits more than `limit` levels deep (the body
    itself is level 1), looking at `budget` values at most (deepest first): past them the
    worker's parser refuses it, in the same words."""
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value
        budget -= len(children)
        if budget < 0:
            return False
        for child in children:
            if isinstance(child, (dict, list)):
                if depth == limit:
                    return True
                stack.append((child, depth + 1))
    return False


class BodyParser:
    def __init__(self, keys: KeyBuilder, processes: int, memory_bytes: int) -> None:
        self.keys = keys
        self.children = ChildPool(processes, memory_bytes)
        self._generation = -1   # the keys' generation the children were started with

    async def parse(self, path: str, body: bytes) -> ParsedBody:
        """Raises `BadRequest` (400) or `BodyTooComplex` (413)."""
        if len(body) <= INLINE_BODY_BYTES:
            return parse_body(self.keys, path, body)
        if self._generation != self.keys.generation:
            self._generation = self.keys.generation
            self.children.restart(_start_child, (self.keys.settings(),))
        try:
            return await self.children.run(_parse_in_child, path, body)
        except TooBig as exc:
            raise BodyTooComplex(
                f"request body could not be parsed within the gateway's parse {exc}") from None

    def close(self) -> None:
        self.children.close()


# --- in the child processes ---------------------------------------------------------------------
_child_keys: KeyBuilder | None = None


def _start_child(settings: tuple) -> None:
    global _child_keys
    _child_keys = KeyBuilder.from_settings(settings)


def _parse_in_child(path: str, body: bytes) -> ParsedBody:
    assert _child_keys is not None
    return parse_body(_child_keys, path, body)
