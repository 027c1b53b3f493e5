"""Which JSON-schema keywords the grammar enforces, checked on xgrammar's own matcher: a schema
whose keyword xgrammar (0.2.8) would drop, letting through text that does not validate, is
refused naming the keyword's place; what pydantic models generate compiles, and its grammar
holds their constraints. No model: grammars only."""

from __future__ import annotations

import datetime
import enum
import json
import uuid
from typing import Annotated, Literal

import jsonschema
import pydantic
import pytest

from radixpool.worker.grammar.json_schema import JSON_SEPARATORS, json_schema_ebnf


def accepts(schema: dict, text: str) -> bool:
    import xgrammar as xgr

    grammar = xgr.Grammar.from_ebnf(json_schema_ebnf(json.dumps(schema)))
    return xgr.testing._is_grammar_accept_string(grammar, text)


def invalid(schema: dict, document) -> bool:
    validator = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    return not validator(schema).is_valid(document)


STRING = {"type": "string"}
INTEGERS = {"type": "array", "items": {"type": "integer"}}


# Each schema's grammar, before it was refused, accepted the document, which does not validate.
@pytest.mark.parametrize("schema,document,place", [
    # the other keywords beside $ref / const / enum / anyOf / oneOf / allOf were dropped
    ({"$defs": {"s": STRING}, "$ref": "#/$defs/s", "maxLength": 2}, "abc", "#/maxLength"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/o", "required": ["b"]}},
      "required": ["a"], "$defs": {"o": {"type": "object", "properties": {
          "b": {"type": "integer"}}}}}, {"a": {}}, "#/properties/a/required"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, {}, "#/type"),
    ({"oneOf": [STRING, {"type": "integer"}], "maxLength": 1}, "ab", "#/maxLength"),
    ({"allOf": [STRING], "maxLength": 1}, "ab", "#/maxLength"),
    ({"type": "string", "enum": ["a", 1]}, 1, "#/type"),
    ({"const": "a", "enum": ["b"]}, "a", "#/enum"),
    # a pattern's (or a known format's) expression was used alone
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "abcd", "#/maxLength"),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, "ab", "#/minLength"),
    ({"type": "string", "format": "date", "pattern": "^2020"}, "2021-01-01", "#/pattern"),
    # multipleOf: never on numbers; on integers, not past 1024 nor with one bound or a wide range
    ({"type": "number", "multipleOf": 0.5}, 1.2, "#/multipleOf"),
    ({"type": "integer", "multipleOf": 5, "minimum": 0}, 3, "#/multipleOf"),
    ({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 10000}, 3, "#/multipleOf"),
    ({"type": "integer", "multipleOf": 2000}, 3, "#/multipleOf"),
    ({"type": "integer", "multipleOf": 2.5}, 3, "#/multipleOf"),
    # with no type and nothing to guess one from, any value was allowed
    ({"minLength": 2}, "a", "#/minLength"),
    ({"type": "object", "properties": {"n": {"minimum": 2}}, "required": ["n"]}, {"n": 1},
     "#/properties/n/minimum"),
    ({"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, {}, "#/anyOf/"),
    # only the names in `properties` are forced or checked
    ({"type": "object", "required": ["b"], "additionalProperties": {"type": "integer"}},
     {"a": 1}, "#/required"),
    ({"type": "object", "properties": {"zz": {"type": "integer"}},
      "propertyNames": {"pattern": "^[a-c]+$"}}, {"zz": 1}, "#/propertyNames"),
    # dropped whatever they hold
    ({**INTEGERS, "contains": {"const": 5}}, [1], "#/contains"),
    ({**INTEGERS, "contains": {"const": 5}, "maxContains": 1}, [5, 5], "#/contains"),
    ({"$defs": {"s": {"$anchor": "S", "type": "string"}}, "$ref": "#S"}, 1, "#/$ref"),
    ({"$dynamicAnchor": "n", "type": "object", "properties": {"c": {"$dynamicRef": "#n"}}},
     {"c": 1}, "#/properties/c/$dynamicRef"),
    # draft 7's spelling of dependentRequired and dependentSchemas
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependencies": {"a": ["b"]}}, {"a": 1}, "#/dependencies"),
])
def test_a_keyword_the_grammar_would_drop_is_refused_naming_its_place(schema, document, place):
    assert invalid(schema, document)
    with pytest.raises(ValueError, match=r"is not enforced|can be followed") as info:
        json_schema_ebnf(json.dumps(schema))
    assert str(info.value).startswith(place), info.value


class Color(str, enum.Enum):
    red = "red"
    green = "green"


class Address(pydantic.BaseModel):
    street: str = pydantic.Field(min_length=1, max_length=20, description="the street")
    zip: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    lives: int = pydantic.Field(ge=0, le=9)


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    barks: bool


class Node(pydantic.BaseModel):
    value: int
    children: list[Node] = []


class Person(pydantic.BaseModel):
    age: int = pydantic.Field(ge=0, lt=150)
    height: float = pydantic.Field(gt=0, le=3)
    step: int = pydantic.Field(multiple_of=5)
    nick: str | None = None
    color: Color = Color.red
    mode: Literal["a", "b"]
    home: Address
    work: Address | None = pydantic.Field(default=None, description="work address")
    old: list[Address] = []
    scores: dict[str, int]
    keys: dict[Literal["x", "y"], int]
    ranks: dict[Color, int]
    pair: tuple[int, str]
    tags: set[str]
    pet: Annotated[Cat | Dog, pydantic.Field(discriminator="kind")]
    born: datetime.date
    seen: datetime.datetime
    id: uuid.UUID
    tree: Node
    site: pydantic.HttpUrl | None = None


GOOD = {"age": 30, "height": 1.5, "step": 10, "nick": None, "color": "red", "mode": "a",
        "home": {"street": "Rue", "zip": "75001"}, "work": None, "old": [],
        "scores": {"a": 1}, "keys": {"x": 1}, "ranks": {"red": 1}, "pair": [1, "a"], "tags": ["t"],
        "pet": {"kind": "cat", "lives": 3}, "born": "2020-01-02",
        "seen": "2020-01-02T03:04:05Z", "id": str(uuid.UUID(int=5)),
        "tree": {"value": 1, "children": [{"value": 2, "children": []}]},
        "site": "http://example.com/"}


@pytest.mark.parametrize("change", [
    {"age": 150}, {"height": 0}, {"step": 3}, {"color": "blue"}, {"mode": "c"},
    {"home": {"street": "Rue", "zip": "7500"}}, {"home": {"street": "", "zip": "75001"}},
    {"scores": {"a": "x"}}, {"keys": {"z": 1}}, {"ranks": {"blue": 1}}, {"pair": ["a", 1]},
    {"pet": {"kind": "cat", "barks": True}}, {"born": "2020-13-01"}, {"id": "x"},
    {"tree": {"value": 1, "children": [{"value": "x", "children": []}]}},
])
def test_what_pydantic_generates_compiles_and_its_constraints_hold(change):
    schema = Person.model_json_schema()
    dump = lambda doc: json.dumps(doc, separators=JSON_SEPARATORS)   # noqa: E731
    Person.model_validate(GOOD)
    assert accepts(schema, dump(GOOD))
    with pytest.raises(pydantic.ValidationError):
        Person.model_validate({**GOOD, **change})
    assert not accepts(schema, dump({**GOOD, **change}))
