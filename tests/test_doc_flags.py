"""The flags the README and docs name for a `radixpool` subcommand are that subcommand's flags,
with the defaults its parser gives them (docs/gateway.md has its own test in tests/gateway)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from radixpool.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def options(command: str) -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {o: a for a in sub.choices[command]._actions for o in a.option_strings
            if o.startswith("--") and o != "--help"}


def section(doc: str, start: str, end: str) -> str:
    text = (REPO / doc).read_text()
    begin = text.index(start)
    return text[begin:text.index(end, begin)]


def table_rows(text: str) -> list[tuple[list[str], str]]:
    """(flags in the first cell, second cell) of each markdown table row naming flags."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) >= 2 and cells[0].startswith("`--"):
            rows.append((FLAG.findall(cells[0]), cells[1]))
    return rows


# (doc, where the subcommand's flags are named, where that ends, subcommand, a full table?,
#  a table whose second column is the default?)
PLACES = [
    ("docs/worker.md", "## Flags", "## Lifecycle", "worker", True, True),
    ("docs/local-fleet.md", "## `radixpool up`", "## `radixpool demo`", "up", True, True),
    ("docs/kubernetes.md", "### `radixpool operator`", "## A pool", "operator", False, False),
    ("README.md", "Flags (`radixpool worker --help`)", "Everything else", "worker", False, False),
    ("README.md", "| flag | default |", "All flags:", "gateway", False, True),
]


@pytest.mark.parametrize(("doc", "start", "end", "command", "full", "defaults"), PLACES,
                         ids=[f"{p[0]}:{p[3]}" for p in PLACES])
def test_documented_flags_exist_with_their_defaults(doc, start, end, command, full, defaults):
    flags = options(command)
    text = section(doc, start, end)
    named = set(FLAG.findall(text)) - {"--help"}
    unknown = sorted(named - set(flags))
    assert not unknown, f"{doc} names {unknown}, which `radixpool {command}` does not take"
    if full:
        undocumented = sorted(set(flags) - named)
        assert not undocumented, f"{doc} does not document {undocumented}"
    for row_flags, default in table_rows(text) if defaults else []:
        shown = re.findall(r"`([^`]*)`", default)
        values = [flags[f].default for f in row_flags]
        if len(shown) != len(values) or any(isinstance(v, bool) for v in values):
            continue   # a default said in words ("the worker's", "on"), not one value per flag
        for flag, value, text_value in zip(row_flags, values, shown):
            if isinstance(value, (int, float, str)):
                spellings = {str(value), f"{value:g}"} if isinstance(value, float) else {str(value)}
                assert text_value in spellings, \
                    f"{doc}: {flag} documented as {text_value!r}, default is {value!r}"
