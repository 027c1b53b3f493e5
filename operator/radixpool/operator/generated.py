"""Files generated from one source of truth and kept in several folders (CRDs, dashboards)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path


def write_copies(repo_root: Path, folders: Iterable[str], files: dict[str, str]) -> list[Path]:
    """Write every file into every folder under `repo_root`; returns the paths written."""
    written = []
    for folder in folders:
        for name, text in files.items():
            path = repo_root / folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(path)
    return written


def repo_root_argument(what: str) -> Path:
    """The repository root a generator's command line names (default: the current folder),
    checked before anything is written: `--help` or a wrong folder writes nothing."""
    parser = argparse.ArgumentParser(description=f"Write {what} into the repository.")
    parser.add_argument("repo_root", nargs="?", type=Path, default=Path("."),
                        help="the repository's root folder (default: the current folder)")
    root = parser.parse_args().repo_root
    if not (root / "pyproject.toml").is_file():
        parser.error(f"{root} is not the repository's root (it has no pyproject.toml)")
    return root
