"""`radixpool worker` flags and the frozen `ServerConfig` they are validated into.

Torch-free (stdlib + the engine's config dataclass), so `radixpool worker --help` answers at once.
Engine defaults are read from `EngineConfig` itself: one source of truth for every default.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import NoReturn

from radixpool.http_edge import EdgeLimits
from radixpool.keys import KeySource, read_key
from radixpool.worker.config import (
    DEVICES,
    DTYPES,
    EVICTION_POLICIES,
    JUMP_FORWARD_MODES,
    LOG_LEVELS,
    SCHEDULE_POLICIES,
    EngineConfig,
)
from radixpool.worker.server.tool_format import TOOL_FORMAT_FLAGS, TOOL_FORMATS

API_KEY_ENV = "RADIXPOOL_API_KEY"
CONTROL_KEY_ENV = "RADIXPOOL_CONTROL_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    control_api_key: str | None = None   # for the gateway: required on /flush_cache, /kv_events...
    drain_timeout: float = 30.0      # seconds
    log_level: str = "info"
    tool_call_format: str = "auto"   # "auto": from the chat template
    unhealthy_after_nonfinite: int = 8   # consecutive non-finite requests that break it; 0: off
    edge: EdgeLimits = field(default_factory=EdgeLimits)

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty name")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be ≥ 0 seconds, got {self.drain_timeout}")
        if self.tool_call_format not in TOOL_FORMAT_FLAGS:
            raise ValueError(f"tool_call_format must be one of {', '.join(TOOL_FORMAT_FLAGS)}")
        if self.unhealthy_after_nonfinite < 0:
            raise ValueError("unhealthy_after_nonfinite must be ≥ 0 (0: never), got "
                             f"{self.unhealthy_after_nonfinite}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it to serve without a key)")
        if self.control_api_key is not None and self.control_api_key == self.api_key:
            raise ValueError("the control key must differ from the serving key")


def _default(name: str):
    return next(f.default for f in fields(EngineConfig) if f.name == name)


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR",
                   help="Hugging Face model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="name clients put in `model` (default: the model directory's name)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1; `::` in a pod: every IPv6 "
                        "and IPv4 address, IPv4 only where IPv6 is off)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--device", choices=DEVICES, default=_default("device"),
                   help="cpu, cuda, or auto: cuda when available (default: auto)")
    p.add_argument("--dtype", choices=DTYPES, default=_default("dtype"),
                   help="weight and KV dtype; auto: bfloat16 on GPU, float32 on CPU")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-tokens", type=int, metavar="N",
                        help="KV pool size in tokens (default: sized from --mem-fraction on GPU, "
                             "a CPU default otherwise)")
    budget.add_argument("--mem-fraction", type=float, metavar="F",
                        help="fraction of free accelerator memory for the KV pool, in (0, 1) "
                             "(default on GPU: 0.85; CPU: refused, use --kv-cache-tokens)")
    p.add_argument("--page-size", type=int, default=_default("page_size"),
                   help="KV page size in tokens, a power of two; cache hits are page-aligned "
                        f"(default: {_default('page_size')})")
    p.add_argument("--max-running-requests", type=int, default=_default("max_running_requests"),
                   help="most requests decoded together "
                        f"(default: {_default('max_running_requests')})")
    p.add_argument("--chunked-prefill-size", type=int, default=_default("chunked_prefill_size"),
                   help="prompt tokens computed per request per step; longer prompts are "
                        f"prefilled in chunks (default: {_default('chunked_prefill_size')})")
    p.add_argument("--max-prefill-tokens", type=int, metavar="N",
                   help="new tokens (prefill + decode) one engine step may compute, at least "
                        f"--chunked-prefill-size (default: {_default('max_prefill_tokens')}, "
                        "or --chunked-prefill-size when that is larger); every decoding "
                        "request still gets its token, past it if need be, and prompts wait")
    p.add_argument("--schedule-policy", choices=SCHEDULE_POLICIES,
                   default=_default("schedule_policy"),
                   help="waiting-queue order: lpm (longest cached prefix first) or fcfs "
                        f"(default: {_default('schedule_policy')})")
    p.add_argument("--eviction-policy", choices=EVICTION_POLICIES,
                   default=_default("eviction_policy"),
                   help="radix cache eviction order: lru, lfu (with ageing) or probation "
                        "(never-reused leaves first) (default: "
                        f"{_default('eviction_policy')})")
    p.add_argument("--context-length", type=int, metavar="N",
                   help="cap the model's context length (may only shrink it)")
    p.add_argument("--attention-backend", default=_default("attention_backend"),
                   help="attention backend: auto, torch or flashinfer (default: auto = "
                        "flashinfer on a CUDA GPU with the flashinfer-python package and a "
                        "bf16/fp16 model of head dim 64 or 128, else torch)")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="run decode steps eagerly instead of replaying the CUDA graphs captured "
                        "at start-up (GPU with the flashinfer backend only)")
    p.add_argument("--jump-forward", choices=JUMP_FORWARD_MODES, default=_default("jump_forward"),
                   help="structured output, the text a grammar forces: exact = draft it and "
                        "verify the draft in one forward pass (same tokens as token by token), "
                        "retokenize = append its canonical tokenization unverified, off = one "
                        "forward pass per token (default: exact)")
    p.add_argument("--grammar-compile-timeout", type=float, metavar="SECONDS",
                   default=_default("grammar_compile_timeout_s"),
                   help="how long a structured-output request may wait for its grammar to "
                        "compile before it is refused with a 400 (a compile under way goes on "
                        "and is cached) (default: "
                        f"{_default('grammar_compile_timeout_s'):g})")
    p.add_argument("--watchdog-timeout", type=float, metavar="SECONDS",
                   default=_default("watchdog_timeout_s"),
                   help="an engine core silent this long while requests wait on it is taken "
                        "for stuck (a hung GPU) and killed: its requests get 503 "
                        "engine_core_died and the worker exits 1 to be restarted (default: "
                        f"{_default('watchdog_timeout_s'):g})")
    p.add_argument("--no-jump-forward", dest="jump_forward", action="store_const", const="off",
                   help="the same as --jump-forward off")
    p.add_argument("--debug-invariants", action="store_true",
                   help="check KV cache invariants whenever the engine goes idle (slow)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every endpoint except /health, "
                        f"/livez and /metrics (default: ${API_KEY_ENV}, else no key)")
    p.add_argument("--control-api-key-file", metavar="PATH",
                   help="file holding the control key: required on /flush_cache, /kv_events, "
                        "/kv_events/snapshot and /prefix_probe, accepted everywhere (give it "
                        f"to the gateway only; default: ${CONTROL_KEY_ENV}, else those paths "
                        "take the serving key)")
    p.add_argument("--startup-timeout", type=float, default=_default("startup_timeout_s"),
                   metavar="SECONDS",
                   help="how long loading the model (weights, KV pool, CUDA graphs) may take "
                        "before the worker gives up and exits 1; in a pod, the startup probe's "
                        f"budget (default: {_default('startup_timeout_s'):g})")
    p.add_argument("--skip-warmup", action="store_true",
                   help="say ready without first running two short requests through the "
                        "model (by default they run, so kernels a GPU builds or loads on first "
                        "use are ready before the first client's request; counted in "
                        "--startup-timeout)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long running requests may take to finish before they "
                        "are aborted; keep it below the pod's terminationGracePeriodSeconds "
                        "(default: 30)")
    p.add_argument("--header-read-timeout", type=float, default=EdgeLimits.header_read_timeout,
                   metavar="SECONDS",
                   help="how long a request's head (request line and headers) may take to "
                        "arrive, from its first byte; slower clients get 408 (default: "
                        f"{EdgeLimits.header_read_timeout:g})")
    p.add_argument("--max-header-bytes", type=int, default=EdgeLimits.max_header_bytes,
                   metavar="N", help="largest request head (request line and headers) taken; "
                                     f"larger get 431 (default: {EdgeLimits.max_header_bytes})")
    p.add_argument("--body-read-timeout", type=float, default=EdgeLimits.body_read_timeout,
                   metavar="SECONDS",
                   help="how long a request's body may take to arrive after its head; slower "
                        f"clients get 408 (default: {EdgeLimits.body_read_timeout:g})")
    p.add_argument("--max-connections", type=int, default=EdgeLimits.max_connections,
                   metavar="N",
                   help="client connections open at once (fewer if the open-file limit is "
                        "lower); past it the oldest idle one closes, or 503 if none is idle "
                        f"(default: {EdgeLimits.max_connections})")
    p.add_argument("--write-stall-timeout", type=float, default=EdgeLimits.write_stall_timeout,
                   metavar="SECONDS",
                   help="how long an answer may wait on a client that reads (almost) none of it "
                        "(under 16 KiB); then "
                        "the connection is dropped and its request aborted, freeing its KV "
                        f"(default: {EdgeLimits.write_stall_timeout:g})")
    p.add_argument("--tool-call-format", choices=TOOL_FORMAT_FLAGS, default="auto",
                   help="the syntax the model writes tool calls in: "
                        f"{', '.join(TOOL_FORMATS)}, or auto: read from the chat template "
                        "(<tool_call> → hermes, [TOOL_CALLS] → mistral, Llama 3's JSON calls → "
                        "llama3, else hermes) (default: auto)")
    p.add_argument("--unhealthy-after-nonfinite", type=int,
                   default=ServerConfig.unhealthy_after_nonfinite, metavar="N",
                   help="once the last N requests that reached output all ended with "
                        "non-finite logits (NaN or infinity) and so does a self-check request "
                        "on a fixed prompt, /health and /livez answer 503 until the worker "
                        "restarts: the model, not a prompt, is broken; 0: never (default: "
                        f"{ServerConfig.unhealthy_after_nonfinite})")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="log level (default: info)")


def _control_key(path: str | None) -> str | None:
    """From `--control-api-key-file`, else the environment (never argv: `ps` shows argv)."""
    source = KeySource("control", CONTROL_KEY_ENV, "--control-api-key-file")
    return read_key(source, path, None, os.environ)[0]


def _serving_key(argv_value: str | None) -> str | None:
    """`--api-key`, else $RADIXPOOL_API_KEY read as the gateway reads it (trimmed: a Secret made
    from a file ends with its newline; blank is refused)."""
    if argv_value is not None:
        return argv_value
    return read_key(KeySource("serving", API_KEY_ENV, "--api-key"), None, None, os.environ)[0]


def in_flag_terms(message: str) -> str:
    """An engine error in the worker's terms: each engine setting it names that is also a flag
    (`kv_cache_tokens`, `max_running_requests`) as that flag (`--kv-cache-tokens`). Only names
    with an underscore: plain words such as `model` or `device` stay as they are."""
    flags = _worker_flags()
    return re.sub(r"\b[a-z]+(?:_[a-z]+)+\b",
                  lambda m: flags.get(m.group(0), m.group(0)), message)


@functools.cache
def _worker_flags() -> dict[str, str]:
    parser = argparse.ArgumentParser(add_help=False)
    add_worker_arguments(parser)
    return {action.dest: action.option_strings[0] for action in parser._actions
            if action.option_strings and "_" in action.dest
            and action.option_strings[0].startswith("--")}


def _as_flag(exc: ValueError) -> ValueError:
    """`kv_cache_tokens must be ...` → `--kv-cache-tokens must be ...`; the seconds fields
    (`watchdog_timeout_s`) are flags without their unit (`--watchdog-timeout`)."""
    message = str(exc)
    name = message.split(" ", 1)[0]
    if name.isidentifier() and name == name.lower():
        flag = "--" + name.removesuffix("_s").replace("_", "-")
        message = flag + message[len(name):]
    return ValueError(message)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Validate the flags once; a ValueError names the flag."""
    if not os.path.isdir(args.model):
        raise ValueError(f"--model {args.model!r} is not a directory")
    try:
        return _config_from_args(args, _serving_key(args.api_key),
                                 _control_key(args.control_api_key_file))
    except ValueError as exc:
        raise _as_flag(exc) from None


class _RefusingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def check_worker_flags(argv: Sequence[str]) -> None:
    """A ValueError saying what `radixpool worker ARGV` would refuse at start, short of what
    only its pod has (the model directory, key files, the environment): for the operator,
    which writes the command line of pods it cannot run."""
    parser = _RefusingParser(prog="radixpool worker", add_help=False)
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    try:
        _config_from_args(args, args.api_key, control_api_key=None)
    except ValueError as exc:
        raise _as_flag(exc) from None


def _config_from_args(args: argparse.Namespace, api_key: str | None,
                      control_api_key: str | None) -> ServerConfig:
    engine = EngineConfig(
        model_path=args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_tokens=args.kv_cache_tokens,
        mem_fraction=args.mem_fraction,
        page_size=args.page_size,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=(args.max_prefill_tokens if args.max_prefill_tokens is not None
                            else max(_default("max_prefill_tokens"), args.chunked_prefill_size)),
        schedule_policy=args.schedule_policy,
        eviction_policy=args.eviction_policy,
        attention_backend=args.attention_backend,
        cuda_graph=not args.disable_cuda_graph,
        context_length=args.context_length,
        debug_invariants=args.debug_invariants,
        jump_forward=args.jump_forward,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        watchdog_timeout_s=args.watchdog_timeout,
        startup_timeout_s=args.startup_timeout,
        warmup=not args.skip_warmup,
        log_level=args.log_level,
    )
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    return ServerConfig(
        engine=engine,
        served_model_name=name,
        host=args.host,
        port=args.port,
        api_key=api_key,
        control_api_key=control_api_key,
        drain_timeout=args.drain_timeout,
        log_level=args.log_level,
        tool_call_format=args.tool_call_format,
        unhealthy_after_nonfinite=args.unhealthy_after_nonfinite,
        edge=EdgeLimits(header_read_timeout=args.header_read_timeout,
                        max_header_bytes=args.max_header_bytes,
                        body_read_timeout=args.body_read_timeout,
                        max_connections=args.max_connections,
                        write_stall_timeout=args.write_stall_timeout),
    )
