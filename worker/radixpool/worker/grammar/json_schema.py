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


def json_schema_ebnf(schema: str) -> str:
    """The EBNF grammar of the JSON text `schema` (a JSON Schema document) allows; raises the
    xgrammar error of an invalid schema."""
    import xgrammar as xgr

    schema = json.dumps(_mend_patterns(json.loads(schema)))
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
