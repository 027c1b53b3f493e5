"""Where a JSON request body nests too deeply, named as a field, for the 400 that refuses it.

The parsers stop at a nesting depth of their own: the workers' (pydantic's) a little past 200
levels, the gateway's (Python's `json`) near 1,000, and neither says in which field. A body that
deep is no request any endpoint takes, so both answer 400 `invalid_json` naming the field where
the nesting passes `MAX_DEPTH` levels, found here by one pass over the text's structural tokens
(strings are skipped whole by the regular expression). Only a body a parser already refused is
scanned, and only its first `SCAN_TOKENS` structural tokens (about 15 ms on a 2-vCPU machine):
past them the parser's own message stands.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass

MAX_DEPTH = 200   # the workers' parser takes 201 levels of arrays, 200 of objects
PATH_PARTS = 8    # the field named: the value at the first parts of the path
SCAN_TOKENS = 20_000
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\],]')


@dataclass(slots=True)
class _Level:
    is_object: bool
    member: str | int | None   # the member being read: a key (None before the first), an index
    wants_key: bool = True


@dataclass(frozen=True, slots=True)
class TooDeep:
    param: str | None   # the field whose value nests too deeply (None: the body itself)
    line: int           # where the nesting passes the limit
    column: int

    def message(self) -> str:
        where = f"'{self.param}'" if self.param else "the body"
        return (f"request body is not valid JSON: {where} nests more than {MAX_DEPTH} levels "
                f"deep (line {self.line}, column {self.column})")


def too_deep(text: str, limit: int = MAX_DEPTH, budget: int = SCAN_TOKENS) -> TooDeep | None:
    """Where `text` first opens an object or array more than `limit` levels deep; None when it
    does not within its first `budget` tokens (or is too broken to tell)."""
    levels: list[_Level] = []
    for match in itertools.islice(_TOKEN.finditer(text), budget):
        token = match.group()
        first = token[0]
        if first == '"':
            top = levels[-1] if levels else None
            if top is not None and top.is_object and top.wants_key:
                try:
                    top.member = json.loads(token)
                except ValueError:
                    return None
                top.wants_key = False
        elif first in "{[":
            if len(levels) >= limit:
                start = match.start()
                line = text.count("\n", 0, start) + 1
                column = start - (text.rfind("\n", 0, start) + 1) + 1
                return TooDeep(_path(levels), line, column)
            levels.append(_Level(first == "{", None if first == "{" else 0))
        elif first in "}]":
            if not levels:
                return None
            levels.pop()
        elif levels:   # a comma
            top = levels[-1]
            if top.is_object:
                top.wants_key = True
            else:
                top.member += 1
    return None


def _path(levels: list[_Level]) -> str | None:
    """The path of the value being read, at most `PATH_PARTS` parts down."""
    path = ""
    for level in levels[:PATH_PARTS]:
        member = level.member
        if member is None:
            break
        path += f"[{member}]" if isinstance(member, int) else (f".{member}" if path else member)
    return path or None
