"""Structural OpenAPI v3 schemas: small builders, and the API server's defaulting and validation.

The CRD's schema is written once with these builders (`crd.py`). The operator then applies the
same defaults and checks the same constraints the API server does, so a pool means the same thing
in a unit test, in `examples/` and in a cluster. Only the subset the CRD uses is implemented:
types, int-or-string, enum, minimum / maximum (exclusiveMinimum / exclusiveMaximum as OpenAPI
3.0's booleans), pattern, lengths, required, properties, additionalProperties, items,
preserve-unknown-fields.
Unknown fields are reported (the API server would silently prune them: a typo should not be).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

Schema = dict[str, Any]


@dataclass(frozen=True)
class FieldError:
    """A problem with one field; `path` is the user's dotted path, e.g. `spec.engine.pageSize`."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def _node(kind: str, description: str, default: Any = None, **extra: Any) -> Schema:
    node: Schema = {"type": kind, "description": description}
    if default is not None:
        node["default"] = default
    node.update({key: value for key, value in extra.items() if value is not None})
    return node


INT32_MAX = 2**31 - 1


def integer(description: str, *, default: int | None = None, minimum: int | None = None,
            maximum: int = INT32_MAX) -> Schema:
    """An int32: the API server does not enforce `format`, so `maximum` (at most `INT32_MAX`)
    is what keeps a value the worker's flags and the Deployment cannot take out."""
    return _node("integer", description, default, format="int32", minimum=minimum,
                 maximum=min(maximum, INT32_MAX))


def number(description: str, *, default: float | None = None, minimum: float | None = None,
           maximum: float | None = None, exclusive_minimum: bool | None = None,
           exclusive_maximum: bool | None = None) -> Schema:
    return _node("number", description, default, minimum=minimum, maximum=maximum,
                 exclusiveMinimum=exclusive_minimum, exclusiveMaximum=exclusive_maximum)


def string(description: str, *, default: str | None = None, enum: tuple[str, ...] | None = None,
           pattern: str | None = None, max_length: int | None = None,
           min_length: int | None = None) -> Schema:
    return _node("string", description, default, enum=list(enum) if enum else None,
                 pattern=pattern, maxLength=max_length, minLength=min_length)


def boolean(description: str, *, default: bool | None = None) -> Schema:
    return _node("boolean", description, default)


def int_or_string(description: str, *, default: int | str | None = None,
                  pattern: str | None = None, minimum: int | None = None) -> Schema:
    """`pattern` applies to a string, `minimum` to an integer (as the API server applies them)."""
    node: Schema = {"description": description, "x-kubernetes-int-or-string": True,
                    "anyOf": [{"type": "integer"}, {"type": "string"}]}
    if pattern:
        node["pattern"] = pattern
    if minimum is not None:
        node["minimum"] = minimum
    if default is not None:
        node["default"] = default
    return node


def obj(description: str, properties: dict[str, Schema], *, required: tuple[str, ...] = (),
        defaulted: bool = True, rules: tuple[tuple[str, str], ...] = ()) -> Schema:
    """An object. `defaulted` gives it `default: {}` so the defaults inside it apply even when
    the user leaves the whole object out. `rules` are CEL (rule, message) pairs."""
    node = _node("object", description, {} if defaulted else None, properties=properties)
    if required:
        node["required"] = list(required)
    if rules:
        node["x-kubernetes-validations"] = [{"rule": r, "message": m} for r, m in rules]
    return node


def array(description: str, items: Schema) -> Schema:
    return _node("array", description, items=items)


def string_map(description: str) -> Schema:
    return _node("object", description, additionalProperties={"type": "string"})


def opaque(description: str) -> Schema:
    """A Kubernetes structure passed through as is (affinity, a volume, ...)."""
    return _node("object", description, **{"x-kubernetes-preserve-unknown-fields": True})


def opaque_list(description: str) -> Schema:
    return array(description, opaque("One item; see the Kubernetes core/v1 API."))


def apply_defaults(schema: Schema, value: Any) -> Any:
    """A copy of `value` with the schema's defaults filled in, as the API server does."""
    value = copy.deepcopy(value)
    _default_in_place(schema, value)
    return value


def _default_in_place(schema: Schema, value: Any) -> None:
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default_in_place(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _default_in_place(schema["items"], item)


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
    "integer": (int,), "number": (int, float),
}


def validate(schema: Schema, value: Any, path: str) -> list[FieldError]:
    """Every constraint `value` breaks, each naming its field."""
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return [FieldError(path, f"must be an integer or a string, got {value!r}")]
        if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"],
                                                                            value):
            return [FieldError(path, f"{value!r} is not a valid value")]
        return _check_range(schema, value, path) if isinstance(value, int) else []
    kind = schema.get("type")
    if kind and (not isinstance(value, _TYPES[kind])
                 or (isinstance(value, bool) and kind in ("integer", "number"))):
        return [FieldError(path, f"must be of type {kind}, got {value!r}")]
    errors: list[FieldError] = []
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(str(choice) for choice in schema["enum"])
        errors.append(FieldError(path, f"must be one of {allowed}; got {value!r}"))
    if kind in ("integer", "number"):
        errors += _check_range(schema, value, path)
    if kind == "string":
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(FieldError(path, f"{value!r} does not match {schema['pattern']}"))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(FieldError(path, f"must be at most {schema['maxLength']} characters"))
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(FieldError(path, f"must be at least {schema['minLength']} characters"))
    if kind == "array":
        for index, item in enumerate(value):
            errors += validate(schema["items"], item, f"{path}[{index}]")
    if kind == "object":
        errors += _check_object(schema, value, path)
    return errors


def _check_range(schema: Schema, value: float, path: str) -> list[FieldError]:
    if "minimum" in schema:
        low = schema["minimum"]
        if schema.get("exclusiveMinimum") and value <= low:
            return [FieldError(path, f"must be greater than {low}, got {value}")]
        if value < low:
            return [FieldError(path, f"must be at least {low}, got {value}")]
    if "maximum" in schema:
        high = schema["maximum"]
        if schema.get("exclusiveMaximum") and value >= high:
            return [FieldError(path, f"must be less than {high}, got {value}")]
        if value > high:
            return [FieldError(path, f"must be at most {high}, got {value}")]
    return []


def _check_object(schema: Schema, value: dict, path: str) -> list[FieldError]:
    errors = [FieldError(f"{path}.{name}", "is required")
              for name in schema.get("required", ()) if name not in value]
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return errors
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    for name, item in value.items():
        if name in properties:
            errors += validate(properties[name], item, f"{path}.{name}")
        elif extra is not None:
            errors += validate(extra, item, f"{path}.{name}")
        else:
            errors.append(FieldError(f"{path}.{name}", "unknown field"))
    return errors
