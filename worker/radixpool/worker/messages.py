"""Messages between the engine front end (tokenizer, detokenizer, API) and the engine core process.

Small dataclasses, pickled over the socket pair (`ipc.py`). The front end sends requests and
controls; the core answers with one `StepOutput` per step that produced anything, and one
`ControlReply` per control.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from radixpool.protocol.kv_blocks import KVEvent
from radixpool.worker.sampling_params import SamplingParams


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams     # validated; `n` is fanned out by the front end (one rid per fork)
    seed: int                  # resolved: the request's seed, or a random one
    namespace: str | None = None
    arrival_time: float = 0.0  # time.time() at the front end


@dataclass
class AbortRequest:
    rid: str


@dataclass(frozen=True)
class Shutdown:
    """Tells the core loop to exit. Defined here, not in `core_process` (which runs as
    `__main__`): an unpickled message must be the very class the loop tests against."""


ControlKind = Literal["flush_cache", "kv_snapshot", "check_invariants", "stats", "probe"]


@dataclass
class ControlRequest:
    kind: ControlKind
    token: int                 # echoed in the reply
    payload: Any = None        # probe: (input_ids, namespace)


@dataclass
class ControlReply:
    token: int
    ok: bool
    payload: Any = None
    error: str | None = None


@dataclass(slots=True)
class TokenDelta:
    """What happened to one request in one step."""

    rid: str
    token_ids: list[int]                          # new tokens (usually one)
    logprobs: list[float] | None = None           # logprob of each new token
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finished: bool = False
    finish_reason: str | None = None              # "stop" (eos / stop token), "length", "abort"
    matched_stop_token: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0                        # prompt tokens served from the radix cache
    queue_time: float | None = None               # seconds waited before first admission
    error: str | None = None                      # set when the core refused the request
    internal_error: bool = False                  # the error is the engine's, not the input's
    error_code: str | None = None                 # machine-readable reason (protocol.errors)
    core_seconds: float | None = None             # on the last delta: arrival in core → done


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_capacity_tokens: int
    kv_used_tokens: int
    radix_cache_tokens: int
    evictable_tokens: int
    retracted_total: int
    evicted_tokens_total: int
    kv_double_frees_total: int = 0   # pages freed twice (ignored, counted; raised in debug)
    # grammar compiles: cumulative counts per GRAMMAR_COMPILE_BUCKETS bound then +Inf, and sum
    grammar_compile_buckets: tuple[int, ...] = ()
    grammar_compile_seconds_sum: float = 0.0
    grammar_cache_hits_total: int = 0
    nonfinite_logits_total: int = 0   # requests aborted for NaN / infinite logits


@dataclass
class StepOutput:
    deltas: list[TokenDelta] = field(default_factory=list)
    events: list[KVEvent] = field(default_factory=list)
    stats: EngineStats | None = None


@dataclass
class CoreReady:
    """Sent once by the core after the model is loaded and memory is allocated."""

    model_path: str
    architecture: str
    context_length: int
    vocab_size: int
    kv_capacity_tokens: int
    page_size: int
    kv_block_size: int
    eos_token_ids: tuple[int, ...]
    device: str
    dtype: str
    attention_backend: str
    stats: EngineStats | None = None   # so the front end never has to ask before the first step
    warmup_seconds: float = 0.0        # spent running the warm-up requests (0: skipped)
    # generation_config.json's sampling fields: defaults for requests given as dicts
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


@dataclass
class CoreFailed:
    error: str
