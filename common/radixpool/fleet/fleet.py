"""A local fleet: N `radixpool worker` processes and one `radixpool gateway` on loopback.

`LocalFleet` is what `radixpool up` and `radixpool demo` run, and what the end-to-end tests
drive (kill, restart, flush, restart the gateway). It starts children and stops them by PID,
gateway first (it stops taking requests and finishes its streams), then the workers (each drains
its running requests), so a Ctrl-C loses no answered request and leaves no process behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from radixpool.fleet.process import (
    ChildFailed,
    ChildProcess,
    PortInUse,
    free_port,
    port_is_free,
    radixpool_argv,
)

HOST = "127.0.0.1"
WORKER_START_TIMEOUT_S = 300.0   # a cold start imports torch and loads the model
GATEWAY_START_TIMEOUT_S = 60.0
GATEWAY_GRACE_S = 35.0           # the gateway finishes in-flight requests for up to 30 s
WORKER_DRAIN_S = 10              # `--drain-timeout` given to each worker
GATEWAY_HEALTH_INTERVAL_S = 0.5  # loopback checks are cheap; the fleet notices changes fast


@dataclass(frozen=True)
class FleetSpec:
    model: Path
    workers: int = 2
    port: int = 8080                      # the gateway's; 0 picks a free one
    policy: str = "cache_aware"
    worker_port_base: int | None = None   # worker i listens on base + i; None: free ports
    served_model_name: str | None = None  # default: the model directory's name
    device: str = "auto"
    kv_cache_tokens: int | None = None
    worker_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    log_dir: Path | None = None           # default: a fresh temporary folder

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers: must be at least 1, got {self.workers}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be within [0, 65535], got {self.port}")
        if self.worker_port_base is not None and not (
                self.worker_port_base > 0 and self.worker_port_base + self.workers <= 65536):
            raise ValueError(f"worker-port-base: {self.worker_port_base} + {self.workers} "
                             "workers must stay within [1, 65535]")
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model: {self.model} is not a model directory (no config.json)")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name


@dataclass
class Readiness:
    """What `LocalFleet.start` reports while it waits: which children answer `/health`."""

    workers_ready: int
    workers: int
    gateway_ready: bool
    elapsed_s: float
    pending: list[str] = field(default_factory=list)


class LocalFleet:
    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self._own_log_dir = spec.log_dir is None
        self.log_dir = Path(spec.log_dir or tempfile.mkdtemp(prefix="radixpool-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers = [self._worker(i) for i in range(spec.workers)]
        self.gateway = self._gateway(spec.policy)
        self.gateway_policy = spec.policy

    # --- assembling the children --------------------------------------------------------------
    def _worker(self, i: int) -> ChildProcess:
        spec = self.spec
        port = spec.worker_port_base + i if spec.worker_port_base is not None else free_port()
        argv = ["worker", "--model", str(spec.model), "--served-model-name", spec.model_name,
                "--host", HOST, "--port", str(port), "--device", spec.device,
                "--drain-timeout", str(WORKER_DRAIN_S), "--log-level", "warning"]
        if spec.kv_cache_tokens is not None:
            argv += ["--kv-cache-tokens", str(spec.kv_cache_tokens)]
        return ChildProcess(f"worker {i}", radixpool_argv(*argv, *spec.worker_args), port,
                            self.log_dir / f"worker-{i}.log", HOST, self._worker_env())

    def _worker_env(self) -> dict[str, str]:
        # N engines on one CPU, each with torch's default of one thread per core, spin against
        # each other: on 2 cores, 3 workers answer ~15x slower than with their fair share.
        if "OMP_NUM_THREADS" in os.environ:
            return {}
        return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // self.spec.workers))}

    def _gateway(self, policy: str, port: int | None = None) -> ChildProcess:
        port = port or self.spec.port or free_port()
        argv = ["gateway", "--host", HOST, "--port", str(port), "--policy", policy,
                "--tokenizer", str(self.spec.model),
                "--health-interval", str(GATEWAY_HEALTH_INTERVAL_S), "--log-level", "warning",
                "--worker-urls", *(w.url for w in self.workers)]
        return ChildProcess("gateway", radixpool_argv(*argv, *self.spec.gateway_args), port,
                            self.log_dir / "gateway.log", HOST)

    @property
    def base_url(self) -> str:
        """The OpenAI base URL clients use."""
        return self.gateway.url + "/v1"

    @property
    def worker_urls(self) -> list[str]:
        return [w.url for w in self.workers]

    # --- life cycle ---------------------------------------------------------------------------
    def start(self, progress: Callable[[Readiness], None] | None = None) -> LocalFleet:
        """Start every worker, wait for them, then the gateway, until it routes to all of them.
        On any failure, stops what it started and raises `ChildFailed`."""
        started = time.monotonic()
        try:
            busy = [c for c in (*self.workers, self.gateway) if not port_is_free(HOST, c.port)]
            if busy:
                raise PortInUse(busy)
            for w in self.workers:
                w.start()
            self._wait_workers(started, progress)
            self.gateway.start()
            self.wait_gateway_routes_to_all(started, progress)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_workers(self, started: float, progress) -> None:
        ready: set[int] = set()
        while len(ready) < len(self.workers):
            for i, w in enumerate(self.workers):
                if i in ready:
                    continue
                if w.healthy():
                    ready.add(i)
                elif not w.running:
                    raise ChildFailed(w, f"exited with status {w.exit_code} while loading")
            elapsed = time.monotonic() - started
            if progress is not None:
                progress(Readiness(len(ready), len(self.workers), False, elapsed,
                                   [w.name for i, w in enumerate(self.workers) if i not in ready]))
            if elapsed > WORKER_START_TIMEOUT_S:
                late = next(w for i, w in enumerate(self.workers) if i not in ready)
                raise ChildFailed(late, f"not ready after {WORKER_START_TIMEOUT_S:.0f} s")
            if len(ready) < len(self.workers):
                time.sleep(0.25)

    def wait_gateway_routes_to_all(self, started: float | None = None, progress=None) -> None:
        """Block until the gateway counts every running worker as eligible for traffic."""
        started = time.monotonic() if started is None else started
        deadline = time.monotonic() + GATEWAY_START_TIMEOUT_S
        want = sum(w.running for w in self.workers)
        while True:
            eligible = self.gateway_eligible_workers()
            if progress is not None:
                progress(Readiness(len(self.workers), len(self.workers), eligible >= want,
                                   time.monotonic() - started, [] if eligible >= want
                                   else ["gateway"]))
            if eligible >= want:
                return
            if not self.gateway.running:
                raise ChildFailed(self.gateway, f"exited with status {self.gateway.exit_code}")
            if time.monotonic() > deadline:
                raise ChildFailed(self.gateway, f"routes to {eligible} of {want} workers after "
                                                f"{GATEWAY_START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)

    def gateway_eligible_workers(self) -> int:
        try:
            doc = httpx.get(self.gateway.url + "/workers", timeout=2.0).json()
        except (httpx.HTTPError, ValueError):
            return 0
        return sum(1 for w in doc.get("workers", ()) if w.get("eligible"))

    def stop(self, force: Callable[[], bool] = lambda: False) -> None:
        """Gateway first, then the workers, each by its PID; `force()` turning true (a second
        Ctrl-C) cuts every grace period short."""
        _stop_all([self.gateway], GATEWAY_GRACE_S, force)
        _stop_all(self.workers, WORKER_DRAIN_S + 10, force)
        if self._own_log_dir and not self.failed_children():
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def failed_children(self) -> list[ChildProcess]:
        return [c for c in (*self.workers, self.gateway)
                if c.exit_code not in (None, 0, -9) and c.proc is not None]

    def __enter__(self) -> LocalFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- faults and operations (tests, demos) -------------------------------------------------
    def kill_worker(self, i: int) -> None:
        """SIGKILL worker i: a crash; its engine-core process goes with its process group."""
        self.workers[i].reap()

    def restart_worker(self, i: int) -> ChildProcess:
        """Stop worker i (if running) and start a new instance on the same port."""
        w = self.workers[i]
        if w.running:
            w.stop(WORKER_DRAIN_S + 10)
        w.reap()
        return w.start().wait_ready(WORKER_START_TIMEOUT_S)

    def flush_worker(self, i: int) -> str:
        """`POST /flush_cache` on worker i; returns its new instance id."""
        r = httpx.post(self.workers[i].url + "/flush_cache", timeout=60.0)
        r.raise_for_status()
        return r.json()["instance_id"]

    def restart_gateway(self, policy: str | None = None, down_s: float = 0.0) -> ChildProcess:
        """Stop the gateway, stay down `down_s` seconds, start it again on the same port."""
        old = self.gateway
        old.stop(GATEWAY_GRACE_S)
        time.sleep(down_s)
        self.gateway_policy = policy or self.spec.policy
        self.gateway = self._gateway(self.gateway_policy, old.port)
        self.gateway.start().wait_ready(GATEWAY_START_TIMEOUT_S)
        self.wait_gateway_routes_to_all()
        return self.gateway


def _stop_all(children: list[ChildProcess], grace_s: float, force: Callable[[], bool]) -> None:
    for c in children:
        c.signal(signal.SIGTERM)  # each drains, in parallel
    deadline = time.monotonic() + grace_s
    while any(c.running for c in children) and time.monotonic() < deadline and not force():
        time.sleep(0.1)
    for c in children:
        c.reap()

