"""Files generated from one source of truth and kept in several folders (CRDs, dashboards)."""

from __future__ import annotations

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
