"""Engine configuration: one frozen dataclass, validated once at the edge (CLI, Engine(...))."""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULE_POLICIES = ("lpm", "fcfs")
EVICTION_POLICIES = ("lru", "lfu", "probation")  # radixpool.worker.mem.eviction
JUMP_FORWARD_MODES = ("exact", "retokenize", "off")   # structured output, see below
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    device: str = "auto"
    dtype: str = "auto"
    # KV budget: an absolute token count, or a fraction of free accelerator memory (GPU only).
    kv_cache_tokens: int | None = None
    mem_fraction: float | None = None
    page_size: int = 1
    max_running_requests: int = 256
    # Prompt tokens computed per request per step; longer prompts are prefilled chunk by chunk.
    chunked_prefill_size: int = 2048
    # Total new tokens (prefill + decode) one step may compute; decoding requests always get
    # their one token each (more of them than this: the step computes no prompt tokens).
    max_prefill_tokens: int = 8192
    schedule_policy: str = "lpm"
    # Which unlocked radix-cache leaves are freed first: lru | lfu (with ageing) | probation.
    eviction_policy: str = "lru"
    attention_backend: str = "auto"
    # Starvation guard: a request waiting longer than this is admitted before any other.
    max_queue_wait_s: float = 30.0
    # Override of the model's context length (may only shrink it).
    context_length: int | None = None
    # Check the cache/pool invariants whenever the engine goes idle (tests, debugging).
    debug_invariants: bool = False
    # Schedule step N+1 while step N runs (its tokens stay on the device until processed).
    # None: on for CUDA, off on CPU (where nothing runs concurrently to gain from it).
    overlap_schedule: bool | None = None
    # Replay decode steps from CUDA graphs captured at start-up (GPU, with a backend that
    # supports it; up to min(max_running_requests, 256) requests a step).
    cuda_graph: bool = True
    # Fill the weights with random values instead of reading a checkpoint (benchmarks of a real
    # configuration whose weights are not at hand: model_path then needs only config.json).
    random_weights: bool = False
    # Structured output, the text a grammar forces (jump-forward): "exact" drafts it and verifies
    # the draft in one forward pass (the tokens token-by-token decoding would give); "retokenize"
    # appends its canonical tokenization unverified; "off" decodes it token by token. True and
    # False stand for "exact" and "off".
    jump_forward: str = "exact"
    # How long a constrained request may wait for its grammar to compile before it is refused
    # (a 400 naming the constraint); a compile still running then goes on, and is cached.
    grammar_compile_timeout_s: float = 120.0
    # A core that says nothing this long while requests wait on it is taken for stuck (a hung
    # GPU, a deadlock) and killed: its requests fail, and the worker exits to be restarted.
    watchdog_timeout_s: float = 300.0
    # How long the core process may take to start (load the weights, size the KV pool, capture
    # the CUDA graphs) before the engine gives up; a pod's startup budget should be the same.
    startup_timeout_s: float = 900.0
    # Before saying it is ready, run two short requests through every kernel a first request
    # needs (a GPU compiles or loads some on first use), then start the cache over.
    warmup: bool = True
    # What the core process logs (its own process: the front end's logging does not reach it).
    log_level: str = "info"

    def __post_init__(self) -> None:
        def fail(name: str, expected: str) -> None:
            raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")

        if not self.model_path:
            fail("model_path", "a model directory")
        if self.device not in DEVICES:
            fail("device", " | ".join(DEVICES))
        if self.dtype not in DTYPES:
            fail("dtype", " | ".join(DTYPES))
        if self.kv_cache_tokens is not None and self.mem_fraction is not None:
            raise ValueError("set kv_cache_tokens or mem_fraction, not both")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            fail("page_size", "a power of two ≥ 1")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            fail("kv_cache_tokens", f"at least one KV page, ≥ page_size ({self.page_size})")
        if self.mem_fraction is not None and not 0 < self.mem_fraction < 1:
            fail("mem_fraction", "in (0, 1)")
        if self.mem_fraction is not None and self.device == "cpu":
            raise ValueError("mem_fraction sizes the KV cache from free GPU memory; on CPU set "
                             "kv_cache_tokens (or neither)")
        if self.max_running_requests < 1:
            fail("max_running_requests", "≥ 1")
        if self.chunked_prefill_size < self.page_size:
            fail("chunked_prefill_size", f"≥ page_size ({self.page_size})")
        if self.max_prefill_tokens < self.chunked_prefill_size:
            fail("max_prefill_tokens", f"≥ chunked_prefill_size ({self.chunked_prefill_size})")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            fail("schedule_policy", " | ".join(SCHEDULE_POLICIES))
        if self.eviction_policy not in EVICTION_POLICIES:
            fail("eviction_policy", " | ".join(EVICTION_POLICIES))
        if self.max_queue_wait_s <= 0:
            fail("max_queue_wait_s", "> 0")
        if self.context_length is not None and self.context_length < 1:
            fail("context_length", "≥ 1")
        if self.startup_timeout_s <= 0:
            fail("startup_timeout_s", "> 0 seconds")
        if not self.grammar_compile_timeout_s > 0:
            fail("grammar_compile_timeout_s", "> 0 seconds")
        if not self.watchdog_timeout_s >= 2:   # a busy core speaks every second
            fail("watchdog_timeout_s", "≥ 2 seconds")
        if self.log_level not in LOG_LEVELS:
            fail("log_level", " | ".join(LOG_LEVELS))
        if isinstance(self.jump_forward, bool):
            object.__setattr__(self, "jump_forward", "exact" if self.jump_forward else "off")
        if self.jump_forward not in JUMP_FORWARD_MODES:
            fail("jump_forward", " | ".join(JUMP_FORWARD_MODES))
