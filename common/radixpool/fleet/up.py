"""`radixpool up`: a local fleet in the foreground until Ctrl-C.

Prints the OpenAI base URL once the gateway routes to every worker; while it runs, reports
children that exit on their own. The first SIGINT or SIGTERM drains and stops everything it
started (gateway, then workers); a second one stops at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from radixpool.fleet.fleet import FleetSpec, LocalFleet
from radixpool.fleet.process import ChildFailed, PortInUse
from radixpool.fleet.progress import StatusLine, readiness_text, worker_count

BUILTIN_MODEL_NAME = "tiny-llama"


def resolve_model(model: str | None) -> tuple[Path, str | None]:
    """The model directory and the name to serve it as (None: the directory's name). Without
    `model`, the built-in tiny model, made on first use in the cache folder."""
    if model is not None:
        return Path(model).expanduser().resolve(), None
    from radixpool.worker.tiny_model import cache_dir, default_tiny_model

    print(f"using the built-in tiny model (random weights: gibberish text, real caching) "
          f"from {cache_dir()}", file=sys.stderr)
    return default_tiny_model(), BUILTIN_MODEL_NAME


class Interrupts:
    """Counts SIGINT/SIGTERM: the first asks for a drain, the second for an immediate stop."""

    def __init__(self) -> None:
        self.count = 0
        self.event = threading.Event()
        self._previous = {}

    def install(self) -> Interrupts:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame) -> None:
        self.count += 1
        self.event.set()
        if self.count == 1:
            print("\nstopping: draining in-flight requests (Ctrl-C again to stop now)",
                  file=sys.stderr, flush=True)

    @property
    def forced(self) -> bool:
        return self.count >= 2


def run_up(spec: FleetSpec) -> int:
    fleet = LocalFleet(spec)
    interrupts = Interrupts().install()
    status = StatusLine()
    try:
        try:
            fleet.start(lambda r: (status.show(readiness_text(r), final=r.gateway_ready),
                                   _raise_if(interrupts.count > 0)))
        except ChildFailed as exc:
            status.done()
            print(f"radixpool up: {exc}", file=sys.stderr)
            return 1
        except PortInUse as exc:
            print(f"radixpool up: {exc}", file=sys.stderr)
            return 2
        except _Interrupted:
            status.done()
            return 130
        status.done()
        _print_banner(fleet)
        exited: set[str] = set()
        while not interrupts.event.wait(1.0):
            for child in (*fleet.workers, fleet.gateway):
                if not child.running and child.name not in exited:
                    exited.add(child.name)
                    print(f"radixpool up: {child.name} (pid {child.pid}) exited with status "
                          f"{child.exit_code}; log {child.log_path}:\n{child.log_tail(10)}",
                          file=sys.stderr, flush=True)
        return 0
    finally:
        fleet.stop(force=lambda: interrupts.forced)
        interrupts.restore()
        print("stopped: every process this fleet started has exited", file=sys.stderr)


class _Interrupted(Exception):
    pass


def _raise_if(condition: bool) -> None:
    if condition:
        raise _Interrupted


def _print_banner(fleet: LocalFleet) -> None:
    spec = fleet.spec
    workers = "\n".join(f"  {w.name}:         {w.url} (pid {w.pid})" for w in fleet.workers)
    gateway = fleet.gateway
    count = worker_count(len(fleet.workers))
    print(f"""
RadixPool is up: {count} behind a {spec.policy} gateway (pid {gateway.pid}).

  OpenAI base URL:  {fleet.base_url}
  model:            {spec.model_name}
  routing report:   {fleet.gateway.url}/workers
  metrics:          {fleet.gateway.url}/metrics
{workers}
  logs:             {fleet.log_dir}

Try it:
  curl {fleet.base_url}/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{spec.model_name}", "messages": [{{"role": "user", "content": "Hello"}}]}}'

Ctrl-C drains and stops everything.""", flush=True)
