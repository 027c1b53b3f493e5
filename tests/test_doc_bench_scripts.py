"""Every `python bench/NAME.py` the README, docs/ and the scripts' own docstrings show starts as
written: run from the repository root with the installed package, `--help` exits 0 (scripts that
take no arguments, and would run their benchmark, are left out); and every flag the README and
docs/ pass to a bench script (or its subcommand) is one it takes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHOWN = re.compile(r"python3? (bench/\w+\.py)")


def shown_scripts() -> list[str]:
    texts = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "bench").glob("*.py")]
    shown = {m for path in texts for m in SHOWN.findall(path.read_text())}
    return sorted(s for s in shown if "argparse" in (REPO / s).read_text())


@pytest.mark.parametrize("script", shown_scripts())
def test_bench_script_starts_as_the_docs_show(script):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, script, "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"python {script} --help: {done.stderr[-2000:]}"
    assert "usage:" in done.stdout


# a command as the docs show it, inline or in a block (`\` continues it): script, then its words
COMMAND = re.compile(r"(bench/\w+\.py|-m bench\.simfleet)((?:[^`#)\n\\]|\\\n)*)")


def shown_flags() -> dict[tuple[str, str | None], set[str]]:
    """(script, subcommand) -> the flags the README and docs/ pass to it."""
    shown: dict[tuple[str, str | None], set[str]] = {}
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for script, rest in COMMAND.findall(path.read_text()):
            words = rest.replace("\\\n", " ").split()
            sub = words[0] if words and re.fullmatch(r"[a-z]+", words[0]) else None
            flags = {w.split("=")[0] for w in words if w.startswith("--")}
            if flags:
                shown.setdefault((script, sub), set()).update(flags)
    return shown


@pytest.mark.parametrize(("script", "sub"), sorted(shown_flags(), key=str))
def test_bench_flags_the_docs_show_exist(script, sub):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [sys.executable, *script.split()] if script.startswith("-m") \
        else [sys.executable, script]
    done = subprocess.run([*command, *([sub] if sub else []), "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    unknown = sorted(shown_flags()[script, sub] - set(re.findall(r"--[a-z][\w-]*", done.stdout)))
    assert not unknown, f"the docs pass {unknown} to {script} {sub or ''}, which takes no such flag"
