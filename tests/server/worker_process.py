"""A real `radixpool worker` process on a free loopback port, stopped by its own PID.

Built on the product's launcher (`radixpool.fleet.process.ChildProcess`, which `radixpool up`
uses too): the worker runs in its own process group, so stopping it also ends its engine core.
"""

from __future__ import annotations

import signal
from pathlib import Path

from radixpool.fleet.process import ChildProcess, free_port, radixpool_argv

STARTUP_TIMEOUT_S = 180
API_KEY = "sk-test-key"

__all__ = ["API_KEY", "STARTUP_TIMEOUT_S", "WorkerProcess", "free_port"]


class WorkerProcess(ChildProcess):
    def __init__(self, model: Path, log_path: Path, *flags: str, name: str = "tiny") -> None:
        port = free_port()
        argv = radixpool_argv("worker", "--model", str(model), "--served-model-name", name,
                              "--port", str(port), "--device", "cpu", "--kv-cache-tokens", "8192",
                              "--log-level", "info", *flags)
        super().__init__(name, argv, port, log_path)
        self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, headers: dict | None = None) -> WorkerProcess:
        super().wait_ready(STARTUP_TIMEOUT_S)
        return self

    def begin_stop(self) -> None:
        self.signal(signal.SIGINT)

    def stop(self) -> None:
        self.begin_stop()
        self.wait(60)
        self.reap()
