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
import math
import re
from typing import Any

from radixpool.worker.grammar.surrogates import exclude_surrogates, exclude_surrogates_from_regex

JSON_SEPARATORS = (", ", ": ")
_BARE_CHARACTERS = re.compile(r'^(\w+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_ESCAPE_RULE = "radixpool_json_escape"
_JSON_CHARACTER = rf'(([^\0-\x1f\"\\]) | ("\\" {_ESCAPE_RULE}))'
# Keywords whose values are JSON data, not schemas: a "pattern" member there is data.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "discriminator"})
_ESCAPE = (rf'{_ESCAPE_RULE} ::= (([\"\\/bfnrt]) | '
           r'("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))')


# Keywords xgrammar (0.2.8) drops without a word, whose output then need not validate: refused
# (a 400 naming the keyword's place) rather than ignored. `not` is dropped whatever it holds
# (`{"type": "string", "not": {"const": "a"}}` lets "a" through; the grammar's text differs
# only in how the string rule is inlined). `uniqueItems` is dropped too, but it is what a set
# type generates (pydantic's set[str]): it is let through, and documented. Annotations the
# standard does not ask a validator to enforce (`contentMediaType`, an unknown `format`) are
# let through.
_NOT_ENFORCED = ("if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                 "not", "contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef")
# Keywords whose value maps names (not keywords) to schemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})
_LOOKAROUND = re.compile(r"(?<!\\)\(\?<?[=!]")
# xgrammar lowers a schema by the first of these it holds and drops every other assertion beside
# it (`{"$ref": ..., "maxLength": 2}`, `{"anyOf": [...], "required": ["a"]}`); the annotations
# (`title`, `description`, `default`, `format`, pydantic's `discriminator`) do not matter.
_ALONE = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_ASSERTIONS = frozenset({
    "type", "enum", "const", "multipleOf", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "minLength", "maxLength", "pattern", "items", "prefixItems",
    "additionalItems", "unevaluatedItems", "minItems", "maxItems", "uniqueItems", "contains",
    "minContains", "maxContains", "properties", "patternProperties", "additionalProperties",
    "unevaluatedProperties", "propertyNames", "required", "minProperties", "maxProperties",
    "dependentRequired", "dependentSchemas", "dependencies", "allOf", "anyOf", "oneOf", "not",
    "if", "then", "else", "$ref", "$dynamicRef"})
# Without a `type`, xgrammar infers an object from these, an array from those, else any value.
_OBJECT_KEYWORDS = ("properties", "additionalProperties", "unevaluatedProperties")
_ARRAY_KEYWORDS = ("items", "prefixItems", "unevaluatedItems")
_LENGTHS = ("minLength", "maxLength")
# The formats xgrammar lowers to their own expression, dropping a `pattern` and the lengths
# beside them; it ignores the others.
_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6",
                      "hostname", "uuid", "uri", "uri-reference", "uri-template", "json-pointer",
                      "relative-json-pointer"})
# xgrammar enforces an integer's `multipleOf` only up to this, and only with no bound or with
# both bounds at most this many integers apart.
_MULTIPLE_OF_MAX, _MULTIPLE_OF_RANGE_MAX = 1024, 10000


def unenforced(schema: Any) -> str | None:
    """Where `schema` asks for something the grammar would not enforce, and what: None if
    nowhere. Walks the schema's structure, not its data (`enum`, `const`, ...) or property names."""
    stack: list[tuple[Any, str, str | None]] = [(schema, "#", None)]
    while stack:
        node, path, default_type = stack.pop()
        if not isinstance(node, dict):
            continue
        problem = _node_unenforced(node, path, default_type)
        if problem is not None:
            return problem
        for key, value in node.items():
            here = f"{path}/{key}"
            if key in _DATA_KEYWORDS:
                continue
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend((v, f"{here}/{name}", None) for name, v in value.items())
            elif isinstance(value, dict):   # property names are strings, typed or not
                stack.append((value, here, "string" if key == "propertyNames" else None))
            elif isinstance(value, list):
                stack.extend((v, f"{here}/{i}", None) for i, v in enumerate(value))
    return None


def _node_unenforced(node: dict, path: str, default_type: str | None) -> str | None:
    """What of one schema object's own keywords the grammar would not enforce, or None; an
    untyped one is of `default_type`, where that is given."""
    for key, value in node.items():
        here = f"{path}/{key}"
        if key in _NOT_ENFORCED:
            return f"{here}: '{key}' is not enforced by the grammar engine"
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            return (f"{here}: 'allOf' of more than one schema is not enforced by the "
                    f"grammar engine; merge them into one")
        if key == "$ref" and isinstance(value, str) and value != "#" and not value.startswith("#/"):
            return f"{here}: only a reference within the schema ('#' or '#/...') can be followed"
        if key == "pattern" and isinstance(value, str) and _LOOKAROUND.search(value):
            return f"{here}: lookahead and lookbehind are not supported in a pattern"
    alone = next((key for key in _ALONE if key in node), None)
    if alone is not None:
        return _beside_unenforced(node, path, alone)
    types = node.get("type")
    types = {t for t in (types if isinstance(types, list) else [types]) if isinstance(t, str)}
    if not types and default_type is not None:
        types = {default_type}
    if not types:
        if any(key in node for key in _OBJECT_KEYWORDS):
            types = {"object"}
        elif any(key in node for key in _ARRAY_KEYWORDS):
            types = {"array"}
        else:
            asserted = next((key for key in node if key in _ASSERTIONS and key != "type"), None)
            return None if asserted is None else (
                f"{path}/{asserted}: '{asserted}' without a 'type' is not enforced by the "
                f"grammar engine; add a 'type'")
    if "string" in types:
        length = next((key for key in _LENGTHS if key in node), None)
        if "pattern" in node and length is not None:
            return (f"{path}/{length}: '{length}' beside 'pattern' is not enforced by the "
                    f"grammar engine; put the length in the pattern")
        if "pattern" in node and isinstance(node.get("format"), str) and node["format"] in _FORMATS:
            return (f"{path}/pattern: 'pattern' beside 'format' is not enforced by the grammar "
                    f"engine")
    if "multipleOf" in node and ("number" in types or (
            "integer" in types and not _integer_multiple_of_enforced(node))):
        return (f"{path}/multipleOf: 'multipleOf' is not enforced by the grammar engine here "
                f"(only a whole number up to {_MULTIPLE_OF_MAX} of an integer with no bounds, or "
                f"with both, at most {_MULTIPLE_OF_RANGE_MAX} apart)")
    if "object" in types:
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = node.get("required")
        missing = [name for name in required if isinstance(name, str)
                   and name not in properties] if isinstance(required, list) else []
        if missing:
            return (f"{path}/required: required '{missing[0]}' is not enforced by the grammar "
                    f"engine outside 'properties'; add it there")
        if properties and "propertyNames" in node and not _all_valid(node["propertyNames"],
                                                                      list(properties)):
            return (f"{path}/propertyNames: 'propertyNames' is not enforced by the grammar "
                    f"engine on the names in 'properties'")
    return None


def _beside_unenforced(node: dict, path: str, alone: str) -> str | None:
    """What beside `alone` (a keyword xgrammar lowers a schema by, dropping the others) the
    grammar would not enforce: anything that asserts, but for a `const` or `enum` whose every
    value satisfies it."""
    beside = {key: value for key, value in node.items() if key in _ASSERTIONS and key != alone}
    if not beside:
        return None
    if alone in ("const", "enum"):
        values = [node["const"]] if alone == "const" else node["enum"]
        if isinstance(values, list) and _all_valid(beside, values):
            return None
    key = next(iter(beside))
    into = {"$ref": "the referenced schema", "const": "the value", "enum": "the values"}
    return (f"{path}/{key}: '{key}' beside '{alone}' is not enforced by the grammar engine; "
            f"fold it into {into.get(alone, 'each branch')}")


def _all_valid(schema: Any, values: list) -> bool:
    """Whether every value satisfies `schema` (False where it cannot be checked alone)."""
    import jsonschema_rs

    try:
        validator = jsonschema_rs.validator_for(schema)
        return all(validator.is_valid(value) for value in values)
    except (ValueError, jsonschema_rs.ReferencingError):
        return False


def _integer_multiple_of_enforced(node: dict) -> bool:
    """Whether xgrammar enforces this integer schema's `multipleOf` (its bounds are whole
    numbers, or it refuses the schema)."""
    step = node["multipleOf"]
    if not (_is_number(step) and float(step).is_integer() and 0 < step <= _MULTIPLE_OF_MAX):
        return False
    lows = [node[k] + (k != "minimum") for k in ("minimum", "exclusiveMinimum")
            if _is_number(node.get(k))]
    highs = [node[k] - (k != "maximum") for k in ("maximum", "exclusiveMaximum")
             if _is_number(node.get(k))]
    if not lows and not highs:
        return True
    return bool(lows and highs) and min(highs) - max(lows) + 1 <= _MULTIPLE_OF_RANGE_MAX


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
