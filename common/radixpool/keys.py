"""Keys for RadixPool's HTTP endpoints, read from a file or the environment, never the command
line (a process's argv is readable by every user of the host: `ps`, `/proc/PID/cmdline`). Shared
by the gateway (client, worker and admin keys) and the worker (its control key).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class KeySource:
    name: str                   # for messages: "client", "worker", "admin"
    env: str
    file_flag: str
    argv_flag: str | None = None


def read_key(source: KeySource, path: str | None, argv_value: str | None,
             environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(the key or None, a warning or None); a ValueError names the flag or variable at fault."""
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as exc:
            raise ValueError(f"{source.file_flag} {path}: {exc.strerror or exc}") from None
        if not key:
            raise ValueError(f"{source.file_flag} {path}: the file is empty")
        return key, None
    if argv_value is not None:
        if not argv_value:
            raise ValueError(f"{source.argv_flag}: must be non-empty")
        return argv_value, (f"{source.argv_flag} puts the {source.name} key in the process list; "
                            f"use ${source.env} or {source.file_flag} instead")
    key = environ.get(source.env)
    if key is not None and not key.strip():
        raise ValueError(f"${source.env} is set but empty")
    return (key.strip() if key else None), None
