"""Every `radixpool` subcommand's `--help` says each default once, and never `(default: None)`;
the generators' command lines write nothing but into the repository."""

import argparse
import re
import subprocess
import sys

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


@pytest.mark.parametrize("module", ["radixpool.operator.crd", "radixpool.operator.dashboards"])
def test_a_generator_writes_nothing_for_help_or_outside_the_repository(module, tmp_path):
    # `python -m radixpool.operator.crd --help` took `--help` for the repository root: it wrote
    # the CRDs under a new folder named `--help`, then failed on its missing docs/
    for args in (["--help"], []):
        done = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == (0 if args else 2), done.stderr
        assert "usage:" in done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == []
