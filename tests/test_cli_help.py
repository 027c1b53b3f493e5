"""Every `radixpool` subcommand's `--help` says each default once, and never `(default: None)`."""

import argparse
import re

import pytest

from radixpool.cli import build_parser


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_help_states_each_default_once_and_never_none(name):
    text = " ".join(subcommands()[name].format_help().split())   # undo line wrapping
    assert "(default: None)" not in text and "(default: [])" not in text
    for option in re.split(r"\s(?=--?[a-z])", text):
        assert option.count("(default") <= 1, f"{name}: {option!r}"
