"""The gateway's three keys, from the environment or a file, never the command line: a process's
argv is readable by every user of the host (`ps`, `/proc/PID/cmdline`) and lands in pod specs.

- client (`RADIXPOOL_API_KEY`, `--api-key-file`): what clients send to the gateway;
- worker (`RADIXPOOL_WORKER_API_KEY`, `--worker-api-key-file`): what the gateway sends to the
  workers, their control key (default: the client key);
- admin (`RADIXPOOL_ADMIN_API_KEY`, `--admin-api-key-file`): what may change the worker set.

A file wins over the environment. The old `--api-key` / `--worker-api-key` flags still work (the
operator of an older release passes `--api-key`) but draw a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

CLIENT_KEY_ENV = "RADIXPOOL_API_KEY"
WORKER_KEY_ENV = "RADIXPOOL_WORKER_API_KEY"
ADMIN_KEY_ENV = "RADIXPOOL_ADMIN_API_KEY"


@dataclass(frozen=True)
class KeySource:
    name: str                   # for messages: "client", "worker", "admin"
    env: str
    file_flag: str
    argv_flag: str | None = None


CLIENT_KEY = KeySource("client", CLIENT_KEY_ENV, "--api-key-file", "--api-key")
WORKER_KEY = KeySource("worker", WORKER_KEY_ENV, "--worker-api-key-file", "--worker-api-key")
ADMIN_KEY = KeySource("admin", ADMIN_KEY_ENV, "--admin-api-key-file")


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
