"""A bound on the object members (keys) of a JSON request body, checked before it is validated.

Validation costs per value, and makes an error per bad value: a worker validating 11 MiB of
`{"k0": 0, "k1": 0, ...}` (a million unknown keys) made a million pydantic errors, ran out of its
validation child's memory reading them back, and held that child for its whole 30 s time limit
before the client got a 413. No request needs that many members: the largest legitimate objects
are a `logit_bias` over much of a vocabulary and a long chat's messages. So a body whose objects
hold more than `MAX_OBJECT_MEMBERS` members in all is refused first (the worker and the gateway
each answer 400 naming the first unknown field, or `too_many_members`).

Every member has a colon, so a body with no more colons than the bound (nearly every body: a
long prompt has few) passes on a byte count; only past it is the body parsed and its objects
counted, a flat object in one step, stopping as soon as the bound is passed.
"""

from __future__ import annotations

import json
from typing import Any

MAX_OBJECT_MEMBERS = 1 << 17


def over_member_bound(body: bytes, bound: int = MAX_OBJECT_MEMBERS) -> Any | None:
    """The parsed body when its objects hold more than `bound` members in all; None when they
    hold no more, or when `json` cannot read it (validation then says what is wrong)."""
    if body.count(b":") <= bound:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):   # (nesting deeper than Python's stack)
        return None
    return doc if members_exceed(doc, bound) else None


def members_exceed(doc: Any, bound: int) -> bool:
    """Whether the objects in the parsed `doc` hold more than `bound` members in all."""
    stack, members = [doc], 0
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            members += len(value)
            if members > bound:
                return True
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


def too_many_members_message(bound: int = MAX_OBJECT_MEMBERS) -> str:
    return (f"the request body's objects hold more than {bound} members (keys) in all; at most "
            f"{bound} are taken")
