"""One child server process (`radixpool worker` or `radixpool gateway`) on a loopback port.

Each child starts in its own session, so it is the leader of its own process group: a Ctrl-C in
the terminal reaches only the parent (which then stops its children in order), and stopping a
child also ends what the child itself started (a worker's engine-core process) by that group's
id. Nothing here ends a process it did not start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from radixpool.listen import http_url

HEALTH_TIMEOUT_S = 2.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (bind to 0); the child binds it a moment later."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind `host:port` now (nothing listens there)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def radixpool_argv(*args: str) -> list[str]:
    """The command line that runs `radixpool ARGS...` with this interpreter."""
    return [sys.executable, "-m", "radixpool.cli", *args]


class ChildProcess:
    """A server child: started, probed on `GET /health`, stopped by its PID and process group."""

    def __init__(self, name: str, argv: Sequence[str], port: int, log_path: Path,
                 host: str = "127.0.0.1", env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.port = port
        self.url = http_url(host, port)
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> ChildProcess:
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self._close_log()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed when the child is reaped
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               **(self.env or {})}
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def healthy(self) -> bool:
        """True when the child answers `GET /health` with 200 now."""
        try:
            return httpx.get(self.url + "/health", timeout=HEALTH_TIMEOUT_S).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout_s: float) -> ChildProcess:
        """Block until healthy; raise with the log's tail if it exits or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if not self.running:
                raise ChildFailed(self, f"exited with status {self.exit_code} before it was ready")
            if time.monotonic() > deadline:
                raise ChildFailed(self, f"not ready after {timeout_s:.0f} s")
            time.sleep(0.2)
        return self

    def signal(self, sig: int) -> None:
        if self.running:
            self.proc.send_signal(sig)

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM (the servers drain on it), SIGKILL after `grace_s`; then end whatever the
        child left in its process group. Returns the exit status."""
        self.signal(signal.SIGTERM)
        self.wait(grace_s)
        return self.reap()

    def wait(self, timeout_s: float) -> bool:
        """True if the child has exited within `timeout_s`."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def reap(self) -> int | None:
        """SIGKILL the child if it still runs, then its leftover group members; close the log."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        _kill_group(self.proc.pid)
        self._close_log()
        return code

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _kill_group(pgid: int) -> None:
    # The group is the child's own session (start_new_session): only its descendants are in it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class ChildFailed(RuntimeError):
    def __init__(self, child: ChildProcess, what: str) -> None:
        tail = child.log_tail()
        super().__init__(f"{child.name} ({child.url}, pid {child.pid}) {what}; "
                         f"log {child.log_path}" + (f":\n{tail}" if tail else ""))
        self.child = child


class PortInUse(ValueError):
    def __init__(self, children: list[ChildProcess]) -> None:
        taken = ", ".join(f"{c.port} ({c.name})" for c in children)
        super().__init__(f"port {taken} already in use on 127.0.0.1: stop what listens there, "
                         "or pick others (--port 0 / --worker-port-base)")
