"""Whether a constraint may force a long run of text, which jump-forward must then leave alone.

xgrammar's `find_jump_forward_string` computes the whole forced run, with no limit, every time
it is asked, and its cost grows faster than the run: an array of 30,000 items of one `const`
(`minItems`) took 164 s and 22.9 GB on the first call, 10,000 items 15.7 s and 3.2 GB; a regex
`a{10000000}` takes 5 s (linearly, but the run shrinks by one draft per step, so a request pays
it again at every step). A request whose constraint may force more than `LONG_FORCED_CHARS`
decodes its output token by token instead (`CompiledGrammar.may_jump`, decided once per
compile), which costs a mask per token and nothing that grows with the run.

The estimate errs long: a regex's shortest match (its forced text is a prefix of every match);
a grammar's repetition counts multiplied together; a JSON schema's `minItems` multiplied along
nested arrays (following local `$ref`s), times a generous item length.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

LONG_FORCED_CHARS = 4096
ITEM_CHARS = 64          # what one array item is taken to force, at most, in the estimate
_COUNT = re.compile(r"\{\s*(\d+)")
_MAX_REF_DEPTH = 32
_MAX_VISITS = 100_000


def forces_long_text(kind: str, source: str) -> bool:
    if kind == "regex":
        return _shortest_match(source) > LONG_FORCED_CHARS
    if kind == "ebnf":
        return _counts_product(source) > LONG_FORCED_CHARS
    try:
        schema = json.loads(source)
    except (ValueError, RecursionError):
        return False   # it does not compile either
    try:
        return _ItemCount(schema).most(schema, 0) * ITEM_CHARS > LONG_FORCED_CHARS
    except (RecursionError, _TooMuch):
        return True    # too deep or too many references to tell: take the worst


def _shortest_match(pattern: str) -> float:
    try:   # the stdlib's regex parser knows a pattern's (min, max) width
        try:
            from re import _parser as parser
        except ImportError:   # Python 3.10
            import sre_parse as parser
        return parser.parse(pattern).getwidth()[0]
    except Exception:   # syntax Python does not read (xgrammar's own): count repetitions
        return _counts_product(pattern)


def _counts_product(source: str) -> float:
    return math.prod(int(n) for n in _COUNT.findall(source) if int(n) > 1)


class _TooMuch(Exception):
    pass


class _ItemCount:
    """The largest product of `minItems` along a path of nested arrays, following local
    references (at most `_MAX_REF_DEPTH` deep, `_MAX_VISITS` nodes in all)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.visits = 0
        self.done: dict[str, float] = {}   # each reference is counted once
        self.open: set[str] = set()        # references on the current path: a cycle adds 1

    def most(self, node: Any, refs: int) -> float:
        self.visits += 1
        if self.visits > _MAX_VISITS or refs > _MAX_REF_DEPTH:
            raise _TooMuch
        if isinstance(node, list):
            return max((self.most(n, refs) for n in node), default=1)
        if not isinstance(node, dict):
            return 1
        most = 1.0
        for key, value in node.items():
            if key == "$ref":
                if isinstance(value, str) and value.startswith("#"):
                    most = max(most, self._referenced(value, refs))
            elif key not in ("enum", "const", "default", "examples"):
                most = max(most, self.most(value, refs))
        count = node.get("minItems")
        if isinstance(count, int) and count > 1:
            most *= count
        return most

    def _referenced(self, ref: str, refs: int) -> float:
        if ref in self.open:
            return 1   # a recursive schema (a tree): what recursion forces is counted once
        if ref not in self.done:
            self.open.add(ref)
            self.done[ref] = self.most(_resolve(self.root, ref), refs + 1)
            self.open.discard(ref)
        return self.done[ref]


def _resolve(root: Any, ref: str) -> Any:
    node = root
    for part in ref.lstrip("#").split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
