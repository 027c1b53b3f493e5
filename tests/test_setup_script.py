"""`. scripts/setup` (as its header says to use it) activates the environment and leaves the
caller's shell as it was; a failed install stops a script that sources it."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def fake_venv(root: Path, *, installed: bool) -> Path:
    """A venv whose python fails (so an install attempt fails) and whose stamp says installed."""
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    (venv / "bin" / "activate").write_text(
        f'export VIRTUAL_ENV="{venv}" PATH="{venv}/bin:$PATH"\n')
    if installed:
        want = hashlib.sha256((REPO / "pyproject.toml").read_bytes()
                              + (REPO / "scripts" / "setup").read_bytes()).hexdigest()
        (venv / ".radixpool-installed").write_text(want + "\n")
    return venv


def run_bash(venv: Path, script: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "HF_HUB_OFFLINE")}
    return subprocess.run(["bash", "-c", script], cwd=REPO, text=True,
                          env={**env, "RADIXPOOL_VENV": str(venv)}, capture_output=True,
                          timeout=60)


def test_sourcing_setup_activates_and_leaves_the_shell_options_alone(tmp_path):
    venv = fake_venv(tmp_path, installed=True)
    done = run_bash(venv, '. scripts/setup; echo "$VIRTUAL_ENV $HF_HUB_OFFLINE"; set -o | grep -E '
                              '"^(errexit|nounset|pipefail)\\b"; echo "${_radixpool_venv-unset}"'
                          '; type _radixpool_install >/dev/null 2>&1 || echo gone')
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"{venv} 1"
    assert all(line.split() == [line.split()[0], "off"] for line in lines[1:4]), lines
    assert lines[4:] == ["unset", "gone"]


def test_a_failed_install_stops_a_script_that_sources_setup(tmp_path):
    venv = fake_venv(tmp_path, installed=False)
    done = run_bash(venv, ". scripts/setup || echo failed")
    assert done.stdout == "failed\n"
    assert not (venv / ".radixpool-installed").exists()
    done = run_bash(venv, "set -euo pipefail; . scripts/setup; echo reached")   # scripts/demo
    assert done.returncode == 1
    assert "reached" not in done.stdout
