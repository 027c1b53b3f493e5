"""Which JSON-schema keywords the grammar enforces, checked on xgrammar's own matcher: a schema
whose keyword xgrammar (0.2.8) would drop, letting through text that does not validate, is
refused naming the keyword's place. No model: grammars only."""

from __future__ import annotations

import json

import jsonschema
import pytest

from radixpool.worker.grammar.json_schema import json_schema_ebnf


def invalid(schema: dict, document) -> bool:
    return not jsonschema.Draft202012Validator(schema).is_valid(document)


INTEGERS = {"type": "array", "items": {"type": "integer"}}


# Each schema's grammar, before it was refused, accepted the document, which does not validate.
@pytest.mark.parametrize("schema,document,place", [
    # dropped whatever they hold
    ({**INTEGERS, "contains": {"const": 5}}, [1], "#/contains"),
    ({**INTEGERS, "contains": {"const": 5}, "maxContains": 1}, [5, 5], "#/contains"),
    ({"$defs": {"s": {"$anchor": "S", "type": "string"}}, "$ref": "#S"}, 1, "#/$ref"),
    ({"$dynamicAnchor": "n", "type": "object", "properties": {"c": {"$dynamicRef": "#n"}}},
     {"c": 1}, "#/properties/c/$dynamicRef"),
])
def test_a_keyword_the_grammar_would_drop_is_refused_naming_its_place(schema, document, place):
    assert invalid(schema, document)
    with pytest.raises(ValueError, match=r"is not enforced|can be followed") as info:
        json_schema_ebnf(json.dumps(schema))
    assert str(info.value).startswith(place), info.value
