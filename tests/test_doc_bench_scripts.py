"""Every `python bench/NAME.py` the README, docs/ and the scripts' own docstrings show starts as
written: run from the repository root with the installed package, `--help` exits 0 (scripts that
take no arguments, and would run their benchmark, are left out)."""

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
