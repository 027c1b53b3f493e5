"""JSON schemas lowered to EBNF the way the engine decodes them, with xgrammar's length-bounded
strings mended.

Fixed separators (", " and ": ") and no free whitespace: the language of a schema of enums and
bounded values stays finite, and more of the output is forced text that jump-forward can skip.

xgrammar (up to 0.2.8 at least, upstream issue mlc-ai/xgrammar#800) lowers a string with
`minLength` / `maxLength` to a bounded repetition of one bare character class that admits raw
control characters (U+0000-U+001F but CR and LF), which JSON forbids, and no escapes. A model
constrained by it can emit a TAB inside such a string, and `json.loads` then rejects the output.
Each repetition here is one JSON character instead: any character but the controls, quote and
backslash, or one escape sequence (counted as one character, as `maxLength` counts the decoded
string). No class admits a surrogate (`surrogates.py`), nor does any `pattern`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from radixpool.worker.grammar.surrogates import exclude_surrogates, exclude_surrogates_from_regex

JSON_SEPARATORS = (", ", ": ")
_BARE_CHARACTERS = re.compile(r'^(\w+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_ESCAPE_RULE = "radixpool_json_escape"
_JSON_CHARACTER = rf'(([^\0-\x1f\"\\]) | ("\\" {_ESCAPE_RULE}))'
# Keywords whose values are JSON data, not schemas: a "pattern" member there is data.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
_ESCAPE = (rf'{_ESCAPE_RULE} ::= (([\"\\/bfnrt]) | '
           r'("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))')


# Keywords xgrammar (0.2.8) drops without a word, whose output then need not validate: refused
# (a 400 naming the keyword's place) rather than ignored. `not` is dropped whatever it holds
# (`{"type": "string", "not": {"const": "a"}}` lets "a" through; the grammar's text differs
# only in how the string rule is inlined). `uniqueItems` is dropped too, but it is what a set
# type generates (pydantic's set[str]): it is let through, and documented. Annotations the
# standard does not ask a validator to enforce (`contentMediaType`, an unknown `format`) are
# let through.
_NOT_ENFORCED = ("if", "then", "else", "dependentRequired", "dependentSchemas", "not",
                 "contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef")
# Keywords whose value maps names (not keywords) to schemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})
_LOOKAROUND = re.compile(r"(?<!\\)\(\?<?[=!]")


def unenforced(schema: Any) -> str | None:
    """Where `schema` asks for something the grammar would not enforce, and what: None if
    nowhere. Walks the schema's structure, not its data (`enum`, `const`, ...) or property names."""
    stack = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            here = f"{path}/{key}"
            if key in _DATA_KEYWORDS:
                continue
            if key in _NOT_ENFORCED:
                return f"{here}: '{key}' is not enforced by the grammar engine"
            if key == "allOf" and isinstance(value, list) and len(value) > 1:
                return (f"{here}: 'allOf' of more than one schema is not enforced by the "
                        f"grammar engine; merge them into one")
            if key == "$ref" and isinstance(value, str) and value != "#" and not value.startswith(
                    "#/"):
                return (f"{here}: only a reference within the schema ('#' or '#/...') can be "
                        f"followed")
            if key == "pattern" and isinstance(value, str) and _LOOKAROUND.search(value):
                return f"{here}: lookahead and lookbehind are not supported in a pattern"
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend((v, f"{here}/{name}") for name, v in value.items())
            elif isinstance(value, dict):
                stack.append((value, here))
            elif isinstance(value, list):
                stack.extend((v, f"{here}/{i}") for i, v in enumerate(value))
    return None


def json_schema_ebnf(schema: str) -> str:
    """The EBNF grammar of the JSON text `schema` (a JSON Schema document) allows; raises the
    xgrammar error of an invalid schema, or a ValueError for what it would not enforce."""
    import xgrammar as xgr

    document = json.loads(schema)
    problem = unenforced(document)
    if problem is not None:
        raise ValueError(problem)
    schema = json.dumps(_mend_patterns(document))
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False,
                                               separators=JSON_SEPARATORS, strict_mode=True))
    mended, count = _BARE_CHARACTERS.subn(lambda m: f"{m[1]} ::= {_JSON_CHARACTER}", grammar)
    return exclude_surrogates(f"{mended}\n{_ESCAPE}\n" if count else grammar)


def _mend_patterns(node: Any) -> Any:
    """The schema with every `pattern` rewritten to match no surrogate."""
    if isinstance(node, list):
        return [_mend_patterns(item) for item in node]
    if not isinstance(node, dict):
        return node
    return {key: value if key in _DATA_KEYWORDS
            else exclude_surrogates_from_regex(value) if key == "pattern" and isinstance(value, str)
            else _mend_patterns(value)
            for key, value in node.items()}
