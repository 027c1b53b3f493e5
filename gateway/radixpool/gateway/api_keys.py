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

from radixpool.keys import KeySource

CLIENT_KEY_ENV = "RADIXPOOL_API_KEY"
WORKER_KEY_ENV = "RADIXPOOL_WORKER_API_KEY"
ADMIN_KEY_ENV = "RADIXPOOL_ADMIN_API_KEY"

CLIENT_KEY = KeySource("client", CLIENT_KEY_ENV, "--api-key-file", "--api-key")
WORKER_KEY = KeySource("worker", WORKER_KEY_ENV, "--worker-api-key-file", "--worker-api-key")
ADMIN_KEY = KeySource("admin", ADMIN_KEY_ENV, "--admin-api-key-file")
