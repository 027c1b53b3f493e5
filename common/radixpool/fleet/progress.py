"""Progress on stderr, plain text: one line redrawn in place on a terminal, and only the lines
that changed (throttled) when stderr is a file or a CI log."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from radixpool.fleet.fleet import Readiness

BAR_WIDTH = 30
PIPE_INTERVAL_S = 5.0  # at most one line per this many seconds when not on a terminal


class StatusLine:
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last_text = ""
        self._last_time = 0.0
        self._width = 0

    def show(self, text: str, final: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            pad = max(self._width - len(text), 0)
            self.stream.write("\r" + text + " " * pad + ("\n" if final else ""))
            self._width = 0 if final else len(text)
        elif final or (text != self._last_text and now - self._last_time >= PIPE_INTERVAL_S):
            self.stream.write(text + "\n")
            self._last_time = now
        self._last_text = text
        self.stream.flush()

    def done(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


def worker_count(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def readiness_text(r: Readiness) -> str:
    if r.workers_ready < r.workers:
        waiting = ", ".join(r.pending)
        return (f"loading: {r.workers_ready}/{r.workers} workers ready ({r.elapsed_s:.0f} s; "
                f"waiting for {waiting})")
    if not r.gateway_ready:
        return f"loading: {r.workers}/{r.workers} workers ready, gateway connecting " \
               f"({r.elapsed_s:.0f} s)"
    return f"ready: {worker_count(r.workers)} and the gateway in {r.elapsed_s:.0f} s"


def bar(label: str, done: int, total: int, extra: str = "") -> str:
    filled = BAR_WIDTH * done // total if total else BAR_WIDTH
    return f"{label} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total}" + \
        (f" {extra}" if extra else "")
