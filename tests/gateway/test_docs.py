"""docs/gateway.md documents every `radixpool gateway` flag with its real default."""

from __future__ import annotations

import argparse
from pathlib import Path

from radixpool.gateway.cli import register

DOC = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"


def test_every_flag_is_documented_with_its_default():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    gateway = parser._subparsers._group_actions[0].choices["gateway"]
    rows = {line.split("|")[1].strip().strip("`").split(" ")[0]: line
            for line in DOC.read_text().splitlines() if line.startswith("| `--")}
    for action in gateway._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag in (None, "--help"):
            continue
        assert flag in rows, f"{flag} missing from docs/gateway.md"
        default = action.default
        if isinstance(default, (int, float, str)) and not isinstance(default, bool):
            assert f"`{default}`" in rows[flag], f"{flag}: default {default!r} not documented"
